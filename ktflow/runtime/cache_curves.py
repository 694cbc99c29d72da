"""What a GPU expert cache would serve, per MoE layer and cache size, measured from recorded routing.

`cache_curves` replays `runtime.expert_cache`'s refill policy (S rows a layer, refilled after the
prompt and every N decoded tokens with the S experts picked most since the last refill) on the
conversations `ktflow profile` recorded, for every S and for N in `INTERVALS`:
- `hits[S - 1]`: the share of the decode steps' expert reads the S rows served (causal: a
  stretch's reads are served by the rows chosen from the stretch before it, as at run time);
- `copies[S - 1]`: experts copied in per decoded token (the refill after the prompt included).
For B in `BATCHES` the conversations are also taken B at a time in lockstep (`spread`), one read
per expert a step whichever rows picked it: `RoutingProfile.cache_batched`. Ties keep the previous
refill's order (`next_order`, as `ExpertCache.refill_from` does). The placement pass prices a
cached layer by these curves; how they differ from a run: docs/design-notes.md.
"""

from __future__ import annotations

import torch

from ..costmodel.routing import CacheCurve

#: the refill intervals (decoded tokens) the curves are computed for
INTERVALS = (8, 16, 32, 64, 128, 256)
#: conversations decoded together (one cache) that the batched curves price
BATCHES = (2, 4, 8)


def next_order(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The refill policy's order after a window: the previous order stably sorted by the window's
    counts, most first. Its first S experts are an S-row cache's (ties keep the earlier place, so
    a resident expert stays resident), for every S at once; `ExpertCache.refill_from` orders the
    same way."""
    return order[torch.sort(counts[order], descending=True, stable=True).indices]


#: one layer of a run to replay: (the prompt's pick counts, then per refill interval's stretch of
#: decode steps: its pick counts and its expert reads, each [experts])
Run = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]


def lockstep(group: list[dict[int, tuple[torch.Tensor, torch.Tensor]]], every: int) -> dict[int, Run]:
    """A batch of conversations decoded together with one cache, from each one's (prompt counts,
    per-step counts [steps, experts]) per layer: per layer, the Run to replay at refill interval
    `every`: all prompts' counts, then the stretches between refills, cut where `every` decoded
    tokens (the rows of the steps, a member counting while it has steps) have run since the last,
    as `ExpertCache.follow` counts them; a stretch's reads are, per step, each expert any member
    picked, once."""
    out: dict[int, Run] = {}
    for layer in sorted({layer for conv in group for layer in conv}):
        parts = [conv[layer] for conv in group if layer in conv]
        steps = max(st.shape[0] for _, st in parts)
        counts = torch.zeros(steps, parts[0][0].numel(), dtype=torch.int64)
        picked = torch.zeros_like(counts, dtype=torch.bool)
        rows = torch.zeros(steps, dtype=torch.int64)
        for _, st in parts:
            counts[:st.shape[0]] += st
            picked[:st.shape[0]] |= st > 0
            rows[:st.shape[0]] += 1
        cuts, since = [0], 0
        for t, r in enumerate(rows.tolist()):
            since += r
            if since >= every:
                cuts.append(t + 1)
                since = 0
        if cuts[-1] < steps:
            cuts.append(steps)
        spans = list(zip(cuts, cuts[1:]))
        out[layer] = (sum(pr.long() for pr, _ in parts), [counts[a:b].sum(0) for a, b in spans],
                      [picked[a:b].sum(0) for a, b in spans])
    return out


def _replay(run: Run, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(reads served, experts copied in) for S = 1 .. experts - 1, and the run's decode reads and
    picks: the cache first filled by `first`'s order, refilled after the prompt and after each
    stretch but the last, each stretch served by the order chosen before it (causal)."""
    prompt, stretches, reads = run
    experts = prompt.numel()
    s = torch.arange(1, experts)[:, None]
    inside = torch.arange(experts)[None, :] < s  # [S, position]: position < S
    copied = torch.zeros(experts - 1, dtype=torch.float64)

    def refill(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        nonlocal copied
        new = next_order(order, counts.double())
        entering = order.argsort()[new]  # where each of the new order's experts stood before
        copied += ((entering[None, :] >= s) & inside).sum(1).double()  # new in the top S, not in the old
        return new

    order = next_order(torch.arange(experts), first.double())  # the first filling (the profile's totals)
    order = refill(order, prompt)  # the refill after the prompt
    served = torch.zeros(experts - 1, dtype=torch.float64)
    for i, (g, r) in enumerate(zip(stretches, reads)):
        served += r.double()[order].cumsum(0)[:experts - 1]
        if i + 1 < len(stretches):
            order = refill(order, g)
    return served, copied, float(sum(float(r.sum()) for r in reads)), float(sum(float(g.sum()) for g in stretches))


class _Tally:
    """Replays summed per layer, one run at a time (nothing of a run is kept after it)."""

    def __init__(self, first: dict[int, torch.Tensor] | None):
        self.first = first
        self.sums: dict[int, list] = {}  # layer -> [served, copied, reads, picks]

    def add(self, run: dict[int, Run]) -> None:
        for layer, r in run.items():
            if not r[1]:
                continue
            f = self.first[layer] if self.first and layer in self.first else torch.zeros(r[0].numel())
            got = _replay(r, f)
            old = self.sums.get(layer)
            self.sums[layer] = list(got) if old is None else [a + b for a, b in zip(old, got)]

    def curves(self, top_k: int) -> dict[int, CacheCurve]:
        out = {}
        for layer, (served, copied, reads, picks) in sorted(self.sums.items()):
            if reads == 0:
                continue
            tokens = picks / top_k
            out[layer] = CacheCurve(hits=[round(min(1.0, float(x) / reads), 6) for x in served],
                                    copies=[round(float(x) / tokens, 6) for x in copied])
        return out


def spread(n: int, b: int) -> list[list[int]]:
    """n conversations (by index) in batches of b, each batch's members n // b apart, so a batch
    does not take neighbours of an ordered prompt list; the n % b last ones are left out."""
    m = n // b
    return [[i + j * m for j in range(b)] for i in range(m)]


def cache_curves(conversations: list[dict[int, tuple[torch.Tensor, torch.Tensor]]], top_k: int, batch: int = 1,
                 intervals=INTERVALS, first: dict[int, torch.Tensor] | None = None) -> dict[int, dict[int, CacheCurve]]:
    """{interval: {layer: CacheCurve}} of the conversations (per layer: the prompt's pick counts,
    each decode step's [steps, experts]) decoded `batch` at a time in lockstep (`spread`,
    `lockstep`; one at a time by default): `hits` the share of the steps' expert reads served,
    `copies` per decoded token (a row). `first`: per layer, the counts the cache's first filling
    follows (the profile's totals; default: the lowest ids)."""
    out: dict[int, dict[int, CacheCurve]] = {}
    for every in intervals:
        if every < 1:
            raise ValueError(f"refill interval {every}: it must be a whole number of decoded tokens >= 1")
        tally = _Tally(first)
        for members in spread(len(conversations), batch):
            tally.add(lockstep([conversations[i] for i in members], every))
        out[every] = tally.curves(top_k)
    return out
