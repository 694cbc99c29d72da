"""The decode-time GPU expert cache: a split layer's GPU experts refilled, as the model runs, with
the experts recent tokens picked most (plans compiled with `expert_cache=True`).

`ExpertCache(compiled).refill(layer, ids)` makes `ids` (S experts) the layer's GPU experts, waiting
for the copies unless wait=False; `follow()` refills each cached layer after each prefill step and
every `refill_every` decoded tokens from the picks since its last refill; `refill_from(recorder)` is
one such refill. What holds: each step computes every expert once, on the CPU until its row is
filled, on the GPU after; decode steps do not wait for a copy (a graph capture synchronizes the
device, and experts the driver would not page-lock copy synchronously); refills write in place, so
captured CUDA graphs stay valid; a refilled expert computes with the CPU side's weights. A prefill
step that streams a cached layer whole is left alone. Preconditions: backend native or cuda_graph,
no plan streams a subset of a cached layer's experts. The mechanism: docs/design-notes.md.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..backends.base import staged
from .cache_curves import next_order
from ..errors import ConfigError, InputError
from ..ir.graph import Node
from ..ir.ops import Op
from ..ir.types import Device


#: bytes of device memory a refill's copies stage through at a time (its landing and unpacked
#: buffers; at least one expert's): transient, within the plan's VRAM reserve
STAGE_BYTES = 256 << 20


@dataclass
class CachedLayer:
    """One cached layer: its GPU parts' stacked weights (one per distinct copy, with the node it
    was loaded for), its CPU parts' masks with the experts each one computes when they are not in
    the cache, and the expert in each row."""

    layer: int
    experts: int
    stacks: list[tuple[Node, dict]] = field(default_factory=list)
    masks: list[tuple[torch.Tensor, set[int]]] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)  # row -> expert (-1: emptied: its copy under way, or failed)
    every: int = 0  # the plan's refill interval (decoded tokens)
    order: list[int] = field(default_factory=list)  # every expert, the rows' first (ties at a refill keep it)


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
        if not hasattr(be, "cpu_expert_stager"):
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
                if n.op == Op.FETCH and len(n.attrs.ids) != n.attrs.experts:
                    raise ConfigError(f"plan {plan.phase} streams a subset of layer {layer}'s experts to the GPU "
                                      f"({n.name}), fixed at compile time, but its GPU experts are a cache: a pass of "
                                      "this pipeline streamed them (place_prefill_experts streams such a layer whole "
                                      "or not at all)")
                if n.op != Op.ROUTED_EXPERTS or n.attrs.cache_size:
                    continue  # (a prefill step streaming the layer whole: every expert from its fetch, no cache)
                c = self.layers.setdefault(layer, CachedLayer(layer, n.attrs.experts))
                if n.place.device == Device.GPU:
                    stacked = be.stacked(n)
                    if not c.resident:
                        c.resident, c.every = list(n.attrs.ids), n.attrs.refill_every
                        c.order = c.resident + [e for e in range(c.experts) if e not in c.resident]
                    elif sorted(c.resident) != sorted(n.attrs.ids):
                        raise ConfigError(f"layer {layer}'s GPU parts hold different experts ({n.name}): a cache "
                                          "needs one set per layer")
                    if id(stacked["local"]) not in seen:
                        seen.add(id(stacked["local"]))
                        c.stacks.append((n, stacked))
                else:
                    mask = be.cpu_expert_mask(n)
                    if mask is None:
                        raise ConfigError(f"{n.name} holds only its own experts: its layer's GPU part is not a cache "
                                          "(compile with expert_cache=True)")
                    if id(mask) not in seen:
                        seen.add(id(mask))
                        groups.setdefault((plan.phase, layer, n.attrs.rank_range, n.attrs.rows), []).append(
                            (mask, set(n.attrs.ids)))
        self._cuda = any(stacked["local"].is_cuda for c in self.layers.values() for _, stacked in c.stacks)
        # copies on a stream of their own: the plan's copy lane must not queue behind them
        self.copy_stream = torch.cuda.Stream() if self._cuda else None
        # where refills copy from: each cached layer's CPU side (every expert, packed)
        self.stagers = {}
        for layer, c in self.layers.items():
            cpu = [n for n in compiled.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.layer == layer
                   and n.place.device != Device.GPU]
            self.stagers[layer] = be.cpu_expert_stager(cpu, compiled.model.weights, c.stacks[0][1]["gate"].device)
            if self._cuda and not self.stagers[layer].page_lock():
                from ..util import notices

                notices.warn(f"expert cache: the driver would not page-lock layer {layer}'s CPU experts; its "
                             "refills copy from pageable memory, and each refill holds the decode loop until its "
                             "copies land", key=f"expert-cache-unpinned-{layer}")
        # (layer, row, expert, the event its copy ends at (None: done), `tokens` when it was issued)
        self.pending: list[tuple[CachedLayer, int, int, torch.cuda.Event | None, int]] = []
        self.copied = 0  # experts copied in since this cache was made
        self.copied_bytes = 0  # their bytes over PCIe, every stack of the layer
        # decoded picks counted at follow()'s refills, and those the GPU rows held at the time
        self.served = self.picked = 0
        # where the cache's time goes: the host's seconds at follow()'s step ends (copies taken in,
        # counters read, refills begun and their copies issued: the decode loop waits for them), and
        # the tokens run between a copy's issue and its expert taking the row (the row empty all the while)
        self.host_seconds = 0.0
        self.tokens = 0  # tokens of the decode steps `follow` saw (prompts not counted)
        self.lag_tokens = 0  # summed over the copies finished
        self.failures = 0  # copies that failed (each warned once per layer; the expert stayed on the CPU)
        self._filled: dict[int, dict[int, int]] = {}  # layer -> expert filled since its refill -> its count then
        self.recorder, self.refills = None, 0
        # the CPU parts computing the same picks and rows split the layer's experts between them (NUMA
        # shards by expert): each expert the cache gives up goes to exactly one of them, dealt in turn;
        # parts over different rows (NUMA shards by rows) each compute all of them
        for (_, layer, _, _), parts in groups.items():
            c = self.layers[layer]
            for i, e in enumerate(sorted(set(range(c.experts)) - set().union(*(own for _, own in parts)))):
                parts[i % len(parts)][1].add(e)
            c.masks += parts

    def resident(self, layer: int) -> tuple[int, ...]:
        """The experts layer `layer`'s GPU rows hold, sorted."""
        return tuple(sorted(self._layer(layer).resident))

    def _layer(self, layer: int) -> CachedLayer:
        if layer not in self.layers:
            raise InputError(f"layer {layer} has no expert cache (cached layers: {sorted(self.layers)})")
        return self.layers[layer]

    def refill(self, layer: int, ids, wait: bool = True) -> int:
        """Make `ids` (as many experts as the layer has rows) the ones layer `layer`'s GPU parts
        compute (module doc); returns how many experts are copied in. Call it between steps. With
        `wait`, returns once they are on the GPU; else after emptying the outgoing rows (the copies
        go on behind the next steps; `poll` finishes them)."""
        c = self._layer(layer)
        want = [int(e) for e in ids]
        if len(set(want)) != len(want) or len(want) != len(c.resident) or not all(0 <= e < c.experts for e in want):
            raise InputError(f"layer {layer}'s cache has {len(c.resident)} rows for distinct experts of "
                             f"0..{c.experts - 1}; got {want}")
        self.poll(wait=True, layer=layer)  # this layer's previous copies done first
        c.order = want + [e for e in c.order if e not in want]
        # in id order, the CPU side's arena order: neighbours copy as one run
        incoming = sorted(e for e in want if e not in c.resident)
        free = [s for s, e in enumerate(c.resident) if e not in want]
        if incoming:
            self._begin(c, free)
            self._copy(c, free, incoming)
            if wait:
                self.poll(wait=True)
        return len(incoming)

    def _after_steps(self):
        """On CUDA, an event after the work issued so far (the steps that read a row before it is
        overwritten): on the current stream and the backend's decode and copy streams."""
        if not self._cuda:
            return None
        events = []
        be = self.backend
        for stream in {torch.cuda.current_stream(), getattr(be, "gpu_stream", None), getattr(be, "copy_stream", None)}:
            if stream is None:
                continue
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
        return events

    def _begin(self, c: CachedLayer, rows: list[int]) -> None:
        """Empty `rows`: their experts computed on the CPU from the next step on."""
        from ..backends.native import binding as native

        native.sync()  # no CPU task (a deferred one included) reads the masks while they change
        out = [c.resident[s] for s in rows if c.resident[s] >= 0]  # (a row whose copy failed is empty)
        for s in rows:
            c.resident[s] = -1
        if not out:
            return
        for node, _ in c.stacks:
            self.backend.place_experts(node, dict.fromkeys(out))
        for mask, own in c.masks:
            back = [e for e in out if e in own]
            if back:
                mask[back] = 1
        self._stream_sync()

    def _copy(self, c: CachedLayer, rows: list[int], experts: list[int]) -> None:
        """Issue the copies of `experts` into `rows` of every stack of the layer (module doc);
        `poll` finishes them. A copy that fails to issue warns: its rows stay empty, the experts
        on the CPU, and a later refill copies them again."""
        from ..util import notices

        stream = self.copy_stream
        try:
            # the row indices copied to the device here, on the current stream (idle between steps):
            # a copy from pageable memory first waits for its stream's earlier work, so made on the
            # copy stream it would hold the host until the copies issued before it had landed
            index = torch.tensor(rows, device=c.stacks[0][1]["gate"].device)
            after = self._after_steps()  # (recorded on the streams current here: index included)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None:
                    index.record_stream(stream)  # read there later: not handed out again before
                for ev in after or ():
                    stream.wait_event(ev)
                stager = self.stagers[c.layer]
                # a bounded number of experts at a time: the landing and unpacked buffers (made on
                # this stream, so handed out again only to its later work) stay near STAGE_BYTES
                per = max(1, STAGE_BYTES // (stager.landing_bytes(1) + 3 * stager.hidden * stager.inter
                                             * stager.dtype.itemsize))
                for at in range(0, len(experts), per):
                    part = index[at:at + per]
                    gate, up, down = staged(stager.stage(tuple(experts[at:at + per]), remember=False),
                                            stager.hidden, stager.inter)
                    for node, stacked in c.stacks:
                        lo, hi = node.attrs.rows
                        for role, src in (("gate", gate[:, lo:hi]), ("up", up[:, lo:hi]),
                                          ("down", down[:, :, lo:hi])):
                            stacked[role].index_copy_(0, part, src.to(stacked[role].dtype))
                done = None
                if stream is not None:
                    done = torch.cuda.Event()
                    done.record(stream)
        except Exception as err:  # noqa: BLE001 (a copy's failure must not stop decoding)
            self.failures += len(experts)
            notices.warn(f"expert cache: copying experts {experts} of layer {c.layer} to the GPU failed ({err}); "
                         "they stay on the CPU until a later refill copies them", key=f"expert-cache-copy-{c.layer}")
            return
        self.pending += [(c, row, e, done, self.tokens) for row, e in zip(rows, experts, strict=True)]

    def poll(self, wait: bool = False, layer: int | None = None) -> int:
        """Finish the refills whose copies are done (with `wait`, all of them, or all of `layer`'s,
        waiting): each expert's row named in the map and the expert taken off the CPU masks. Call
        it between steps (`follow` does, at every step's end); returns how many experts it finished."""
        ready, rest = [], []
        for job in self.pending:
            done = job[3]
            if wait and layer is not None and job[0].layer != layer:
                rest.append(job)
            elif wait or done is None or done.query():
                if done is not None:
                    done.synchronize()
                ready.append(job)
            else:
                rest.append(job)
        self.pending = rest
        if not ready:
            return 0
        from ..backends.native import binding as native

        native.sync()
        if self.recorder is not None:  # the picks counted before the row was filled were the CPU's
            counts = self.recorder.read({c.layer for c, *_ in ready})
            for c, _, e, *_ in ready:
                if c.layer in counts:
                    self._filled.setdefault(c.layer, {})[e] = int(counts[c.layer][0][e])
        by_layer: dict[int, list] = {}
        for job in ready:
            by_layer.setdefault(job[0].layer, []).append(job)
        for jobs in by_layer.values():
            c = jobs[0][0]
            for _, row, e, _, queued in jobs:
                self.lag_tokens += self.tokens - queued
                c.resident[row] = e
                for mask, own in c.masks:
                    if e in own:
                        mask[e] = 0
            # the layer's finished experts take their rows: one write of each stack's map
            for node, _ in c.stacks:
                self.backend.place_experts(node, {e: row for _, row, e, *_ in jobs})
        self._stream_sync()
        self.copied += len(ready)
        for c, row, *_ in ready:
            self.copied_bytes += sum(stacked[role][row].numel() * stacked[role].element_size()
                                     for _, stacked in c.stacks for role in ("gate", "up", "down"))
        return len(ready)

    def _stream_sync(self) -> None:
        """The map's small writes done before a step on another stream reads it."""
        if self._cuda:
            torch.cuda.current_stream().synchronize()

    def follow(self, every: int | None = None):
        """Refill from the routing as the model runs: a `RoutingRecorder` on every plan; after
        each prefill step every cached layer, and after decode steps each layer whose
        `refill_every` (or `every`, for all) decoded tokens have run since its last refill, is
        refilled with the experts counted most since then, without waiting for the copies (the
        layer's counters then zeroed in place, so captured graphs stay valid); finished copies are
        taken in at every step's end; after a decode step, a layer whose last copies are still under
        way waits for a later step's end instead of blocking this one (after a prefill step the
        refill waits for them: the prompt's picks must not stay counted). `served / picked` is the share of decoded
        picks (prompts' left out) that GPU rows held, each row from when its copy landed.
        Refills happen between calls of a plan, so with greedy runs
        of K steps a launch an interval rounds up to a multiple of K; in a ragged batch (`SlotPool`)
        each listed row's token counts toward it, the padding rows' do not (nor their picks). Returns the recorder; `stop()`
        undoes it."""
        from .routing import RoutingRecorder, attach

        if every is not None and (not isinstance(every, int) or every < 1):
            raise InputError(f"every must be a whole number of decoded tokens >= 1, got {every!r}")
        self.stop()
        self.recorder, self.refills, self._filled = RoutingRecorder(), 0, {}
        self.every = {layer: every or c.every for layer, c in self.layers.items()}
        self.since = dict.fromkeys(self.layers, 0)
        attach(self.compiled, self.recorder)  # (beside a recorder already there: a run's --record-routing)
        for plan in (self.compiled.decode, *self.compiled.prefill):
            self.compiled.executor(plan).after_run.append(self._after_run)
        return self.recorder

    def stop(self) -> None:
        """No more refills from routing (copies under way are finished; the experts resident stay)."""
        from .routing import detach

        try:
            self.poll(wait=True)
        finally:
            for plan in (self.compiled.decode, *self.compiled.prefill):
                ex = self.compiled.executor(plan)
                if self._after_run in ex.after_run:
                    ex.after_run.remove(self._after_run)
            if self.recorder is not None:
                detach(self.compiled, self.recorder)

    def _after_run(self, executor, tokens: int) -> None:
        t0 = time.perf_counter()
        try:
            self._step_end(executor, tokens)
        finally:
            self.host_seconds += time.perf_counter() - t0

    def _step_end(self, executor, tokens: int) -> None:
        tokens = self.recorder.counted(tokens)  # a ragged batch's padding rows are no decoded tokens
        prefill = executor.plan.phase == "prefill"
        if not prefill:
            self.tokens += tokens
        self.poll()
        busy = {c.layer for c, *_ in self.pending}  # copies still under way: refilled at a later step's end
        due = []
        for layer in self.layers:
            self.since[layer] += tokens
            if prefill or (self.since[layer] >= self.every[layer] and layer not in busy):
                due.append(layer)
        if due:
            counts = self.recorder.read(due)
            if not prefill:  # what the rows served since the last refill (a prompt's picks not counted)
                for layer, (picks, _) in counts.items():
                    held = [e for e in self.layers[layer].resident if e >= 0]
                    since = self._filled.get(layer, {})  # an expert filled in the window: its picks from then
                    self.served += int(picks[held].sum()) - sum(since.get(e, 0) for e in held)
                    self.picked += int(picks.sum())
            self._refill_by(counts, wait=False)
            for layer in due:  # (after the refills: a copy they wait for is counted from the reset on)
                self._filled.pop(layer, None)
            self.recorder.reset(due)
            self._stream_sync()  # the zeroed counters before the next replay adds to them
            for layer in due:
                self.since[layer] = 0
            self.refills += 1

    def refill_from(self, recorder, layers=None, wait: bool = True) -> dict[int, int]:
        """Refill every cached layer (or those in `layers`) with its most counted experts in
        `recorder` (a `RoutingRecorder`; a layer it counted no tokens of keeps its experts; ties
        keep the order of the refill before, so a resident expert stays: `cache_curves.next_order`,
        the rule the placement pass's curves replay); returns the experts copied in per layer."""
        return self._refill_by(recorder.read(self.layers if layers is None else layers), wait)

    def _refill_by(self, counts: dict[int, tuple[torch.Tensor, int]], wait: bool) -> dict[int, int]:
        """`refill_from` given the counters (`RoutingRecorder.read`) of the layers to refill."""
        out = {}
        for layer, (picks, rows) in sorted(counts.items()):
            c = self.layers.get(layer)
            if c is None or rows == 0:
                continue  # nothing routed since the last refill: the experts resident stay
            order = next_order(torch.tensor(c.order), picks).tolist()
            out[layer] = self.refill(layer, order[:len(c.resident)], wait=wait)
            c.order = order
        return out

