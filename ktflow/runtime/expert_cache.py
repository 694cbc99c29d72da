"""The decode-time GPU expert cache: a split layer's GPU experts refilled, between steps, with the
experts recent tokens picked most.

A plan compiled with `expert_cache=True` marks each split layer's GPU part `cached`: its subset
is the first filling of S expert slots, and the layer's CPU parts hold every expert (packed once),
each computing the experts its mask marks. `ExpertCache(compiled).refill(layer, ids)` then makes
`ids` (S experts) the GPU's:

- each incoming expert's weights are read from the checkpoint and copied into the slot of an
  outgoing one, in every stacked copy of the layer's GPU parts (every plan's; plans over the same
  node share one);
- the GPU parts' expert -> slot maps (`local`) and the CPU parts' masks are rewritten in place.

In place is what keeps captured CUDA graphs valid: a replayed decode step reads the stacked
weights, the map and (through the native task) the mask at the addresses it was captured with, so
the next replay computes the new split without capturing again. `refill_from(recorder)` refills
every cached layer with its S most counted experts of a `RoutingRecorder` (which counts inside
captured graphs too: `runtime.routing`), and `follow(every)` does that as the model runs: after
each prefill step and every `every` decoded tokens, from the picks since the last refill (the
policy benchmarks/cache_hits.py measures on held-out text).

Preconditions: the plan's backend is native or cuda_graph (their CPU parts take a mask), and no
plan streams a cached layer's experts to the GPU in prefill (a streamed subset is fixed at compile
time; `place_prefill_experts` keeps a cached layer's experts on the CPU, so only a custom pass
could). Not yet built: the refill runs on the calling thread
between steps (the copies are not on the copy stream behind decode steps), no pass prices the
cache's hits and copies or sizes its slots (they are the placement's GPU share of the layer), and
no token-wise prefetch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import node_key
from ..errors import ConfigError, InputError
from ..ir.graph import Node
from ..ir.ops import Op
from ..ir.types import Device


@dataclass
class CachedLayer:
    """One cached layer: its GPU parts' stacked weights (one per distinct copy, with the node it
    was loaded for), its CPU parts' masks with the experts each one computes when they are not in
    the cache, and the expert in each slot."""

    layer: int
    experts: int
    stacks: list[tuple[Node, dict]] = field(default_factory=list)
    masks: list[tuple[torch.Tensor, set[int]]] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)  # slot -> expert


class ExpertCache:
    """The cached layers of a compiled model (module doc), refilled in place."""

    def __init__(self, compiled):
        plans = [compiled.decode, *compiled.prefill]
        cached = {n.attrs.layer for n in compiled.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.cached}
        if not cached:
            raise ConfigError("the decode plan has no cached GPU experts: compile with expert_cache=True and a VRAM "
                              "budget that splits some layer's experts between the GPU and the CPU")
        self.compiled = compiled
        be = compiled.executor(compiled.decode).backend
        for plan in plans:
            compiled.executor(plan)  # every plan's weights loaded, its masks made
        if not hasattr(be, "masks"):
            raise ConfigError(f"the expert cache needs a backend whose CPU experts take a mask (native or cuda_graph), "
                              f"not {be.name}")
        self.backend = be
        self.layers: dict[int, CachedLayer] = {}
        seen: set[int] = set()
        groups: dict[tuple, list[tuple[torch.Tensor, set[int]]]] = {}
        for plan in plans:
            for n in plan.ir.nodes:
                layer = getattr(n.attrs, "layer", None)
                if layer not in cached:
                    continue
                if n.op == Op.FETCH:
                    raise ConfigError(f"plan {plan.phase} streams layer {layer}'s experts to the GPU ({n.name}), a "
                                      "subset fixed at compile time, but its GPU experts are a cache: a pass of "
                                      "this pipeline streamed them (place_prefill_experts keeps them on the CPU)")
                if n.op != Op.ROUTED_EXPERTS:
                    continue
                c = self.layers.setdefault(layer, CachedLayer(layer, n.attrs.experts))
                if n.place.device == Device.GPU:
                    stacked = be.stacked(n)
                    if not c.resident:
                        c.resident = list(n.attrs.ids)
                    elif sorted(c.resident) != sorted(n.attrs.ids):
                        raise ConfigError(f"layer {layer}'s GPU parts hold different experts ({n.name}): a cache "
                                          "needs one set per layer")
                    if id(stacked["local"]) not in seen:
                        seen.add(id(stacked["local"]))
                        c.stacks.append((n, stacked))
                else:
                    mask = be.masks.get(node_key(n))
                    if mask is None:
                        raise ConfigError(f"{n.name} holds only its own experts: its layer's GPU part is not a cache "
                                          "(compile with expert_cache=True)")
                    if id(mask) not in seen:
                        seen.add(id(mask))
                        groups.setdefault((plan.phase, layer, n.attrs.rank_range, n.attrs.rows), []).append(
                            (mask, set(n.attrs.ids)))
        # the CPU parts computing the same picks and rows split the layer's experts between them (NUMA
        # shards by expert): each expert the cache gives up goes to exactly one of them, dealt in turn;
        # parts over different rows (NUMA shards by rows) each compute all of them
        for (_, layer, _, _), parts in groups.items():
            c = self.layers[layer]
            for i, e in enumerate(sorted(set(range(c.experts)) - set().union(*(own for _, own in parts)))):
                parts[i % len(parts)][1].add(e)
            c.masks += parts

    def resident(self, layer: int) -> tuple[int, ...]:
        """The experts layer `layer`'s GPU slots hold, sorted."""
        return tuple(sorted(self._layer(layer).resident))

    def _layer(self, layer: int) -> CachedLayer:
        if layer not in self.layers:
            raise InputError(f"layer {layer} has no expert cache (cached layers: {sorted(self.layers)})")
        return self.layers[layer]

    def refill(self, layer: int, ids) -> int:
        """Make `ids` (as many experts as the layer has slots) the ones layer `layer`'s GPU parts
        compute; returns how many experts were copied in. Call it between steps: it waits for the
        work in flight first."""
        from .. import native

        c = self._layer(layer)
        want = [int(e) for e in ids]
        if len(set(want)) != len(want) or len(want) != len(c.resident) or not all(0 <= e < c.experts for e in want):
            raise InputError(f"layer {layer}'s cache has {len(c.resident)} slots for distinct experts of "
                             f"0..{c.experts - 1}; got {want}")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        native.sync()
        incoming = [e for e in want if e not in c.resident]
        free = [s for s, e in enumerate(c.resident) if e not in want]
        weights = self.compiled.model.weights
        for slot, e in zip(free, incoming, strict=True):
            read = {}  # each tensor read from the checkpoint once, copied into every stack of the layer
            for node, stacked in c.stacks:
                rows = slice(*node.attrs.rows)
                for ref in node.weights:
                    if ref.experts:
                        if ref.key not in read:
                            read[ref.key] = weights.load_expert(ref, e)
                        index = (slice(None), rows) if ref.role == "down" else (rows,)
                        stacked[ref.role][slot].copy_(read[ref.key][index])
            c.resident[slot] = e
        for node, stacked in c.stacks:
            local = stacked["local"]
            local.fill_(-1)
            local[torch.tensor(c.resident, device=local.device)] = torch.arange(len(c.resident), device=local.device)
            held = self.backend.weights.get(node_key(node))
            if held is not None:  # the per-expert view the stack was made from, kept in step with it
                for role in ("gate", "up", "down"):
                    held[role] = {e: stacked[role][s] for s, e in enumerate(c.resident)}
        for mask, own in c.masks:
            mask.zero_()
            mask[sorted(own - set(c.resident))] = 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(incoming)

    def follow(self, every: int = 16):
        """Refill from the routing as the model runs: a `RoutingRecorder` on every plan, and after
        each prefill step and every `every` decoded tokens, each cached layer refilled with the
        experts counted most since the last refill (the counters then zeroed in place, so captured
        graphs stay valid). Refills happen between calls of a plan, so with greedy runs of K steps
        a launch `every` rounds up to a multiple of K; a ragged batch's padding rows (`SlotPool`)
        count toward `every` (their picks are not counted). Returns the recorder; `stop()` undoes it."""
        from .routing import RoutingRecorder

        if not isinstance(every, int) or every < 1:
            raise InputError(f"every must be a whole number of decoded tokens >= 1, got {every!r}")
        self.stop()
        self.recorder, self.every, self.pending, self.refills = RoutingRecorder(), every, 0, 0
        for plan in (self.compiled.decode, *self.compiled.prefill):
            ex = self.compiled.executor(plan)
            ex.recorder = self.recorder
            ex.after_run.append(self._after_run)
        return self.recorder

    def stop(self) -> None:
        """No more refills from routing (the experts resident stay)."""
        for plan in (self.compiled.decode, *self.compiled.prefill):
            ex = self.compiled.executor(plan)
            if self._after_run in ex.after_run:
                ex.after_run.remove(self._after_run)
                ex.recorder = None

    def _after_run(self, executor, tokens: int) -> None:
        self.pending += tokens
        if executor.plan.phase == "prefill" or self.pending >= self.every:
            self.refill_from(self.recorder)
            self.recorder.reset()
            self.pending = 0
            self.refills += 1

    def refill_from(self, recorder) -> dict[int, int]:
        """Refill every cached layer with its most counted experts in `recorder` (a
        `RoutingRecorder`; a layer it counted no tokens of keeps its experts; ties keep a resident
        expert, then the lower id); returns the experts copied in per layer."""
        out = {}
        for layer, c in sorted(self.layers.items()):
            if layer not in recorder.counts or int(recorder.rows[layer]) == 0:
                continue  # nothing routed since the last refill: the experts resident stay
            counts = recorder.counts[layer].cpu()
            here = set(c.resident)  # ties keep an expert already resident (no copy for nothing)
            order = sorted(range(c.experts), key=lambda e: (-int(counts[e]), e not in here, e))
            out[layer] = self.refill(layer, order[:len(c.resident)])
        return out
