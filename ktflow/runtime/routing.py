"""Recording real routing: how often each MoE layer's router picks each expert (and each pair of
experts together), counted as a plan runs, written as the `RoutingProfile` the placement pass
reads (`ktflow compile --routing-profile`).

`RoutingRecorder` is attached to executors (`Executor.recorder`): after each router node runs it
adds the step's picks to per-layer counters kept on the device that routed (a scatter-add of
ones, and with `pairs` a one-hot product, and a row count), so recording costs a few small
kernels per layer and no host sync until `profile()` reads the counts. The counters are made once
per layer (`prepare`) and only ever added to in place, so a captured CUDA graph can hold the
additions: the cuda_graph backend prepares them before it captures a decode step with a recorder
attached (and captures again when the recorder changes), and each replay then counts its picks on
the GPU. A ragged batch's padding rows (`SlotPool`) are left out through `set_rows`, a 0/1 weight
per row the step reads from the device. `attach` records as an application runs (`ktflow run` and
`ktflow serve --record-routing`), beside the expert cache's own recorder where there is one
(`RecorderTee`); `record_routing` runs prompts to record a profile with the cache's curves.
"""

from __future__ import annotations

import torch

from ..costmodel.routing import RoutingProfile
from ..ir.graph import Graph
from ..ir.ops import Op


def gate_layers(g: Graph) -> dict[str, int]:
    """Each router node of `g` -> the MoE layer whose routed experts read its picks (through
    copies to another device)."""
    out: dict[str, int] = {}
    for n in g.nodes:
        if n.op != Op.ROUTED_EXPERTS:
            continue
        src = g.by_name(n.inputs[1])
        while src.op == Op.COPY:
            src = g.by_name(src.inputs[0])
        if src.op == Op.GATE:
            out[src.name] = n.attrs.layer
    return out


class RoutingRecorder:
    """Per-layer expert pick counts (and, with `pairs`, pair counts) over the steps it sees."""

    #: rows a step may weigh one by one (`set_rows`); a longer step (a prefill chunk) counts every row
    ROWS = 4096

    def __init__(self, pairs: bool = False):
        self.pairs = pairs
        self.counts: dict[int, torch.Tensor] = {}  # layer -> int64 [experts]
        self.together: dict[int, torch.Tensor] = {}  # layer -> float32 [experts, experts]
        self.rows: dict[int, torch.Tensor] = {}  # layer -> int64 [1]: tokens routed
        self.valid: dict[str, torch.Tensor] = {}  # device -> int64 [ROWS]: 1 for a row to count, 0 to skip
        self._count_rows: torch.Tensor | None = None  # what set_rows last said (for a device seen later)

    def prepare(self, layer: int, experts: int, device) -> None:
        """Make `layer`'s counters on `device` (zero) if they are missing: before a graph that
        adds to them is captured (a counter made during capture would be zeroed by every replay)."""
        if layer not in self.counts:
            self.counts[layer] = torch.zeros(experts, dtype=torch.int64, device=device)
            self.rows[layer] = torch.zeros(1, dtype=torch.int64, device=device)
            if self.pairs:
                self.together[layer] = torch.zeros(experts, experts, dtype=torch.float32, device=device)
        self._valid(self.counts[layer].device)

    def _valid(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self.valid:
            self.valid[key] = torch.ones(self.ROWS, dtype=torch.int64, device=device)
            if self._count_rows is not None:
                self.valid[key][:self._count_rows.numel()].copy_(self._count_rows)
        return self.valid[key]

    def set_rows(self, count: torch.Tensor | None) -> None:
        """Which rows of the next steps to count (bool or 0/1 [rows]: a ragged batch's listed
        rows, not its padding), None for all; written in place, so a captured graph reads it."""
        self._count_rows = None if count is None else count.reshape(-1).to(torch.int64)
        for v in self.valid.values():
            v.fill_(1)
            if count is not None:
                v[:count.numel()].copy_(self._count_rows)

    def counted(self, rows: int) -> int:
        """Of a step's `rows` token rows, how many it counts: the listed rows under `set_rows`
        (a ragged batch's padding left out), else all."""
        return rows if self._count_rows is None else int(self._count_rows[:rows].sum())

    def reset(self, layers=None) -> None:
        """Zero every counter (or those of `layers`) in place (a graph captured with them keeps
        adding to them)."""
        for d in (self.counts, self.rows, self.together):
            for layer, t in d.items():
                if layers is None or layer in layers:
                    t.zero_()

    def add(self, layer: int, ids: torch.Tensor, experts: int) -> None:
        """One step's picks of `layer`'s router: ids [tokens, top_k]. In place on the prepared
        counters, with shapes fixed by `ids` alone: a captured graph may hold it."""
        ids = ids.reshape(-1, ids.shape[-1])
        if layer not in self.counts:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"routing counters of layer {layer} were not prepared before capture")
            self.prepare(layer, experts, ids.device)
        n, k = ids.shape
        flat = ids.reshape(-1).long()
        if n <= self.ROWS:
            weight = self._valid(ids.device)[:n]
            self.counts[layer].scatter_add_(0, flat, weight[:, None].expand(n, k).reshape(-1))
            self.rows[layer].add_(weight.sum())
        else:
            weight = None
            self.counts[layer].scatter_add_(0, flat, torch.ones_like(flat))
            self.rows[layer].add_(n)
        if self.pairs:
            hot = torch.zeros(n, experts, dtype=torch.float32, device=ids.device)
            hot.scatter_(1, ids.long(), 1.0)
            if weight is not None:
                hot.mul_(weight[:, None])
            self.together[layer].add_(hot.T @ hot)

    def read(self, layers) -> dict[int, tuple[torch.Tensor, int]]:
        """Layer -> (its pick counts, its routed rows) on the host, for those of `layers` counted
        here, read in one copy per device the routers ran on (each read of device counters waits
        for the device)."""
        by_device: dict[torch.device, list[int]] = {}
        for layer in sorted(layer for layer in layers if layer in self.counts):
            by_device.setdefault(self.counts[layer].device, []).append(layer)
        out = {}
        for on in by_device.values():
            both = torch.cat([t for layer in on for t in (self.counts[layer], self.rows[layer])]).cpu()
            at = 0
            for layer in on:
                n = self.counts[layer].numel()
                out[layer] = (both[at:at + n], int(both[at + n]))
                at += n + 1
        return out

    def profile(self, model_type: str | None = None) -> RoutingProfile:
        """What was counted, as fractions of each layer's tokens."""
        if not self.counts:
            raise ValueError("no routing was recorded: did the plans run a router (an MoE model, backend native "
                             "or torch_ref)?")
        read = self.read(self.counts)
        tokens = {layer: rows for layer, (_, rows) in read.items()}
        if not any(tokens.values()):
            raise ValueError("no routing was recorded: the routers ran no tokens")
        layers = {layer: [round(float(c) / max(tokens[layer], 1), 6) for c in counts]
                  for layer, (counts, _) in sorted(read.items())}
        pairs = None
        if self.pairs:
            pairs = {layer: [[round(float(v) / max(tokens[layer], 1), 6) for v in row] for row in m.cpu()]
                     for layer, m in sorted(self.together.items())}
        return RoutingProfile(layers=layers, model_type=model_type, tokens=min(tokens.values()), pairs=pairs)


class RecorderTee:
    """Recorders fed by the same routers, each call going to all of them: the expert cache's
    (which it zeroes at each refill) and a whole run's (`attach`)."""

    def __init__(self, *recorders):
        self.recorders = recorders

    def prepare(self, layer: int, experts: int, device) -> None:
        for r in self.recorders:
            r.prepare(layer, experts, device)

    def add(self, layer: int, ids: torch.Tensor, experts: int) -> None:
        for r in self.recorders:
            r.add(layer, ids, experts)

    def set_rows(self, count: torch.Tensor | None) -> None:
        for r in self.recorders:
            r.set_rows(count)


def attach(compiled, recorder: "RoutingRecorder") -> None:
    """From now on `recorder` counts the routing of every plan of `compiled` as it runs, beside a
    recorder already counting there (the expert cache's, `ExpertCache.follow`, attaches the same way). On
    the GPU it counts inside the captured decode graph (a change of recorder captures again), a
    few small kernels a layer (their cost in a decode step not measured). `detach` undoes it."""
    for plan in (compiled.decode, *compiled.prefill):
        ex = compiled.executor(plan)
        ex.recorder = recorder if ex.recorder is None else RecorderTee(ex.recorder, recorder)


def detach(compiled, recorder: "RoutingRecorder") -> None:
    """`recorder` counts no more (a recorder beside it goes on)."""
    for plan in (compiled.decode, *compiled.prefill):
        ex = compiled.executor(plan)
        if ex.recorder is recorder:
            ex.recorder = None
        elif isinstance(ex.recorder, RecorderTee) and recorder in ex.recorder.recorders:
            rest = [r for r in ex.recorder.recorders if r is not recorder]
            ex.recorder = rest[0] if len(rest) == 1 else RecorderTee(*rest)


def record_routing(compiled, prompts: list[list[int]], decode: int = 0, pairs: bool = False, progress: bool = True,
                   continuations: list[list[int]] | None = None):
    """Run each prompt (token ids) through `compiled`, then `decode` greedy tokens after it (or,
    with `continuations`, each prompt's continuation fed one decode step a token: teacher
    forcing), with a RoutingRecorder on every plan; returns the RoutingProfile of all the tokens
    it routed. With decode steps, the profile also holds how often neighbouring decoded tokens
    pick the same expert (`neighbours`, which prices a speculative verification step) and the
    expert cache's curves
    (`ktflow.runtime.cache_curves`): each conversation's picks are read step by step and the refill policy
    replayed on them, one conversation at a time (`cache`) and, for each B of BATCHES, B at a time
    in lockstep (`cache_batched`)."""
    from .cache_curves import BATCHES, cache_curves
    from ..util.progress import bar
    from .execute import execute

    rec = RoutingRecorder(pairs)
    attach(compiled, rec)
    # per conversation that decoded, per layer: (the prompt's pick counts, each step's [steps, experts]
    # as uint8: one row a step picks an expert at most once)
    recorded: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []

    def snapshot() -> dict[int, torch.Tensor]:
        return {layer: c.clone() for layer, c in rec.counts.items()}

    def since(now: dict[int, torch.Tensor], before: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {layer: c - before[layer] if layer in before else c for layer, c in now.items()}

    try:
        if continuations is not None:
            if len(continuations) != len(prompts):
                raise ValueError(f"{len(continuations)} continuations for {len(prompts)} prompts")
            decode = max((len(c) for c in continuations), default=0)
        for j, ids in enumerate(bar(prompts, "profile", "prompt", show=progress and len(prompts) > 1)):
            start = snapshot()
            nxt, state = execute(compiled, torch.tensor([ids]), logits="argmax")
            last = snapshot()
            prompt = since(last, start)
            steps = min(decode if continuations is None else len(continuations[j]), compiled.max_seq_len - len(ids))
            per_step: list[dict[int, torch.Tensor]] = []
            for i in range(steps):
                if continuations is not None:
                    nxt = torch.tensor([continuations[j][i]])
                nxt, state = execute(compiled, nxt.view(1, 1), state, logits="argmax")
                now = snapshot()
                per_step.append({layer: c.to(torch.uint8) for layer, c in since(now, last).items()})
                last = now
            if steps:  # (the prompt routed every MoE layer: each step counts them all)
                recorded.append({layer: (c.cpu(), torch.stack([s_[layer] for s_ in per_step]).cpu())
                                 for layer, c in prompt.items()})
    finally:
        detach(compiled, rec)
    model = compiled.model
    prof = rec.profile(model.config.model_type if model is not None else None)
    if decode > 0 and recorded:
        top_k = next(n.attrs.top_k for n in compiled.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS)
        first = {layer: torch.tensor(fr) for layer, fr in prof.layers.items()}
        curves = {}
        for b in (1, *BATCHES):
            if len(recorded) >= b:
                per = {every: c for every, c in cache_curves(recorded, top_k, b, first=first).items() if c}
                if per:
                    curves[b] = per
        prof = prof.model_copy(update={"cache": curves.pop(1, None), "cache_batched": curves or None,
                                       "neighbours": neighbour_copicks(recorded)})
    return prof


def neighbour_copicks(recorded: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]) -> dict[int, list[float]] | None:
    """Per layer and expert, the fraction of neighbouring decoded token pairs (steps t, t + 1 of
    one conversation) that both picked it, from record_routing's per-step picks; None where no
    conversation decoded two steps."""
    both: dict[int, torch.Tensor] = {}
    pairs = 0
    for conv in recorded:
        for layer, (_, steps) in conv.items():
            s = steps.float()
            if s.shape[0] < 2:
                continue
            both[layer] = both.get(layer, 0) + (s[1:] * s[:-1]).sum(0)
        pairs += max(next(iter(conv.values()))[1].shape[0] - 1, 0) if conv else 0
    if not pairs or not both:
        return None
    return {layer: [round(float(v) / pairs, 6) for v in c] for layer, c in both.items()}
