"""What a GPU expert cache would serve, per MoE layer and cache size, measured from recorded routing.

The decode-time expert cache (`runtime.expert_cache`) keeps S expert slots per layer on the GPU and
refills them after each prompt and every N decoded tokens with the S experts the tokens since the
last refill picked most. Whether that beats a static choice of S experts depends on how sticky the
routing is over N tokens, which frequencies alone do not say. `ktflow profile` therefore counts
each conversation's picks in windows (the prompt, then blocks of `BLOCK` decoded tokens), and
`cache_curves` replays the refill policy on those counts for every S and for N in `INTERVALS`:

- `hits[S - 1]`: the share of decoded tokens' picks the S slots served (a window's picks are
  served by the slots chosen from the window before it: causal, as at run time);
- `copies[S - 1]`: experts copied in per decoded token (a refill copies the experts entering the
  top S; the refill after the prompt counts too).

A serving step decodes a batch of conversations together with one cache, and reads each expert
any of its rows picked once. For B = 2, 4, 8 (`BATCHES`) the profile's conversations are also
taken B at a time in lockstep (`lockstep`: step t of the group is every member's step t): the
refills follow all rows' picks, and `hits` is the share of the steps' expert reads the slots
served (B = 1: a read is a pick). These are `RoutingProfile.cache_batched`, which the placement
pass reads for a plan of `max_batch` > 1.

Ties in a window's counts keep the order of the refill before (`next_order`), as
`ExpertCache.refill_from` does, so a resident expert stays resident on a tie. Two differences
from a run remain: the curves start each conversation from the profile's order (a run starts from
the plan's slots, then the rest by id, and carries its order from one conversation to the next),
which moves the served share by 0.05-0.5% of the picks on tied counts. The placement pass prices a cached layer by these curves (`passes/place.py`).
"""

from __future__ import annotations

import torch

from .cost import CacheCurve

#: decoded tokens per recorded window (the finest refill interval the curves can price)
BLOCK = 8
#: the refill intervals (decoded tokens) the curves are computed for: multiples of BLOCK
INTERVALS = (8, 16, 32, 64)
#: conversations decoded together (one cache) that the batched curves price
BATCHES = (2, 4, 8)


def next_order(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The refill policy's order after a window: the previous order stably sorted by the window's
    counts, most first. Its first S experts are an S-slot cache's (ties keep the earlier place, so
    a resident expert stays resident), for every S at once; `ExpertCache.refill_from` orders the
    same way."""
    return order[torch.sort(counts[order], descending=True, stable=True).indices]


def windows_of(prompt: torch.Tensor, steps: torch.Tensor) -> list[torch.Tensor]:
    """One layer of one conversation in windows: the prompt's pick counts, then each BLOCK decode
    steps' (`steps` [decode steps, experts]: each step's counts; the last window may be short)."""
    return [prompt] + [steps[i:i + BLOCK].sum(0) for i in range(0, steps.shape[0], BLOCK)]


def lockstep(group: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]) -> tuple[dict, dict]:
    """A batch of conversations decoded together, from each one's (prompt counts, per-step counts
    [steps, experts]) per layer: (windows, reads): per layer the windows of the batch's pick
    counts (all prompts, then each BLOCK steps, step t being every member's step t that has one)
    and of its expert reads (per step, each expert any member picked, once)."""
    windows, reads = {}, {}
    for layer in sorted({layer for conv in group for layer in conv}):
        parts = [conv[layer] for conv in group if layer in conv]
        steps = max(st.shape[0] for _, st in parts)
        counts = torch.zeros(steps, parts[0][0].numel(), dtype=torch.int64)
        picked = torch.zeros_like(counts, dtype=torch.bool)
        for _, st in parts:
            counts[:st.shape[0]] += st
            picked[:st.shape[0]] |= st > 0
        windows[layer] = windows_of(sum(pr for pr, _ in parts), counts)
        reads[layer] = windows_of(torch.zeros_like(parts[0][0]), picked.long())
    return windows, reads


def _one(windows: list[torch.Tensor], per: int, first: torch.Tensor,
         reads: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(served reads, experts copied in) for S = 1 .. experts - 1, the decode steps' expert reads
    and their picks, over one conversation's (or lockstep batch's) windows of one layer at a
    refill interval of `per` blocks. `reads`: the windows' expert reads (default: the picks, as in
    a conversation of its own)."""
    experts = windows[0].numel()
    groups = [torch.stack(windows[1 + i:1 + i + per]).sum(0).double() for i in range(0, len(windows) - 1, per)]
    reads = reads or windows
    served_by = [torch.stack(reads[1 + i:1 + i + per]).sum(0).double() for i in range(0, len(reads) - 1, per)]
    s = torch.arange(1, experts)[:, None]
    inside = torch.arange(experts)[None, :] < s  # [S, position]: position < S
    copied = torch.zeros(experts - 1, dtype=torch.float64)

    def refill(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        nonlocal copied
        new = next_order(order, counts)
        entering = order.argsort()[new]  # where each of the new order's experts stood before
        copied += ((entering[None, :] >= s) & inside).sum(1).double()  # new in the top S, not in the old
        return new

    order = next_order(torch.arange(experts), first.double())  # the first filling (the profile's totals)
    order = refill(order, windows[0].double())  # the refill after the prompt
    served = torch.zeros(experts - 1, dtype=torch.float64)
    for i, (g, r) in enumerate(zip(groups, served_by)):  # each group served by the order chosen after the one before
        served += r[order].cumsum(0)[:experts - 1]
        if i + 1 < len(groups):
            order = refill(order, g)
    return served, copied, float(sum(r.sum() for r in served_by)), float(sum(g.sum() for g in groups))


def cache_curves(conversations: list[dict[int, list[torch.Tensor]]], top_k: int, intervals=INTERVALS,
                 first: dict[int, torch.Tensor] | None = None,
                 reads: list[dict[int, list[torch.Tensor]]] | None = None) -> dict[int, dict[int, CacheCurve]]:
    """{interval: {layer: CacheCurve}} from each conversation's windows: per layer, the prompt's
    pick counts, then each block of BLOCK decoded tokens' counts (int [experts] each). `first`:
    per layer, the counts the cache's first filling follows (the profile's totals; default: the
    lowest ids). Only decoded tokens' picks are served and counted. `reads`: for batches decoded
    in lockstep (`lockstep`), each one's windows of expert reads: `hits` is then the share of the
    reads served, `copies` still per decoded token (a row of a step)."""
    out: dict[int, dict[int, CacheCurve]] = {}
    layers = sorted({layer for conv in conversations for layer in conv})
    for every in intervals:
        if every < BLOCK or every % BLOCK:
            raise ValueError(f"refill interval {every} is not a multiple of the recorded window ({BLOCK} tokens)")
        out[every] = {}
        for layer in layers:
            served = copied = None
            wanted = picks = 0.0
            for j, conv in enumerate(conversations):
                wins = conv.get(layer)
                if not wins or len(wins) < 2:
                    continue
                f = first[layer] if first and layer in first else torch.zeros(wins[0].numel())
                h, c, r, n = _one(wins, every // BLOCK, f, reads[j][layer] if reads else None)
                served = h if served is None else served + h
                copied = c if copied is None else copied + c
                wanted += r
                picks += n
            if served is None or wanted == 0:
                continue
            tokens = picks / top_k
            out[every][layer] = CacheCurve(hits=[round(min(1.0, float(x) / wanted), 6) for x in served],
                                           copies=[round(float(x) / tokens, 6) for x in copied])
    return out
