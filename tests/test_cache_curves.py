"""The cache curves (ktflow.cache_curves): the refill policy replayed on recorded windows."""

from __future__ import annotations

import pytest
import torch

from ktflow.cache_curves import BLOCK, cache_curves


def brute(windows, per, first, s):
    """The policy step by step for one S, as ExpertCache.refill_from runs it: the slots are the S
    most counted, ties kept in the order of the refill before (a resident expert stays); after the
    prompt and after every `per` blocks."""
    experts = windows[0].numel()
    order = sorted(range(experts), key=lambda e: -float(first[e]))  # stable: ties by id

    def refill(order, counts):
        return sorted(order, key=lambda e: -float(counts[e]))  # Python's sort is stable

    new = refill(order, windows[0])
    copied, served, picks = len(set(new[:s]) - set(order[:s])), 0.0, 0.0
    order = new
    groups = [torch.stack(windows[1 + i:1 + i + per]).sum(0) for i in range(0, len(windows) - 1, per)]
    for i, g in enumerate(groups):
        served += float(sum(g[e] for e in order[:s]))
        picks += float(g.sum())
        if i + 1 < len(groups):
            new = refill(order, g)
            copied += len(set(new[:s]) - set(order[:s]))
            order = new
    return served, copied, picks


@pytest.mark.parametrize("every", [8, 16, 32])
def test_the_curves_equal_the_policy_replayed_one_size_at_a_time(every):
    g = torch.Generator().manual_seed(every)
    experts, k = 12, 3
    convs, first = [], torch.rand(experts, generator=g)
    for _ in range(3):
        wins = [torch.randint(0, 4, (experts,), generator=g) for _ in range(1 + 9)]
        convs.append({5: wins})
    curves = cache_curves(convs, top_k=k, intervals=(every,), first={5: first})[every][5]
    for s in range(1, experts):
        served = copied = picks = 0.0
        for conv in convs:
            a, b, c = brute(conv[5], every // BLOCK, first, s)
            served, copied, picks = served + a, copied + b, picks + c
        assert curves.hits[s - 1] == pytest.approx(served / picks, abs=1e-6)
        assert curves.copies[s - 1] == pytest.approx(copied / (picks / k), abs=1e-6)


def test_sticky_routing_is_served_and_shifting_routing_is_not():
    experts = 16

    def conv(hot_per_window):
        wins = []
        for hot in hot_per_window:
            w = torch.zeros(experts, dtype=torch.long)
            w[list(hot)] = BLOCK
            wins.append(w)
        return {1: wins}

    sticky = conv([(0, 1)] * 9)  # the same two experts every window
    moving = conv([(2 * i % experts, (2 * i + 1) % experts) for i in range(9)])  # two new experts every window
    c = cache_curves([sticky], top_k=2, intervals=(8,))[8][1]
    assert c.hits[1] == 1.0 and c.copies[1] == 0.0  # two slots serve every pick; nothing copied after the prompt
    m = cache_curves([moving], top_k=2, intervals=(8,))[8][1]
    assert m.hits[1] == 0.0 and m.copies[1] > 0  # last window's experts never come back


def test_an_interval_off_the_recorded_windows_is_refused():
    with pytest.raises(ValueError, match="multiple"):
        cache_curves([{1: [torch.ones(4)] * 3}], top_k=1, intervals=(12,))
