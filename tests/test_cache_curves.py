"""The cache curves (ktflow.runtime.cache_curves): the refill policy replayed on recorded routing."""

from __future__ import annotations

import pytest
import torch

from ktflow.runtime.cache_curves import cache_curves, spread


def brute_batch(convs, every, first, s):
    """One layer of conversations decoded in lockstep, step by step, for one S: (reads served,
    experts copied in, reads, picks). Each conversation is (prompt counts, per-step picked sets);
    a step reads each expert any member picked, once; a refill follows every member's picks since
    the last, once `every` decoded tokens (a row each) have run since it, as ExpertCache counts."""
    experts = first.numel()
    order = sorted(range(experts), key=lambda e: -float(first[e]))

    def refill(order, counts):
        return sorted(order, key=lambda e: -float(counts[e]))

    new = refill(order, sum(p for p, _ in convs))
    copied, served, reads, picks = len(set(new[:s]) - set(order[:s])), 0, 0, 0
    order = new
    steps = max(len(st) for _, st in convs)
    counts, since = torch.zeros(experts), 0
    for t in range(steps):
        step = [st[t] for _, st in convs if t < len(st)]
        union = set().union(*step)
        served += len(union & set(order[:s]))
        reads += len(union)
        for picked in step:
            counts[list(picked)] += 1
            picks += len(picked)
        since += len(step)
        if since >= every and t + 1 < steps:
            new = refill(order, counts)
            copied += len(set(new[:s]) - set(order[:s]))
            order, counts, since = new, torch.zeros(experts), 0
    return served, copied, reads, picks


@pytest.mark.parametrize("every,batch", [(8, 1), (16, 1), (32, 1), (8, 2), (16, 3), (8, 4)])
def test_the_curves_equal_the_policy_run_step_by_step(every, batch):
    """Batch 1: each conversation alone; more: the batch in lockstep."""
    g = torch.Generator().manual_seed(every + batch)
    experts, k = 10, 2
    first = torch.rand(experts, generator=g)

    def conversation(steps):
        prompt = torch.randint(0, 5, (experts,), generator=g)
        picked = [set(torch.randperm(experts, generator=g)[:k].tolist()) for _ in range(steps)]
        per_step = torch.zeros(steps, experts, dtype=torch.uint8)
        for t, p in enumerate(picked):
            per_step[t, list(p)] = 1
        return (prompt, picked), {7: (prompt, per_step)}

    made = [conversation(steps) for steps in (40, 33, 40, 25, 31, 19, 28)]  # ragged: a member may end first
    curves = cache_curves([m[1] for m in made], k, batch, intervals=(every,), first={7: first})[every][7]
    for s in range(1, experts):
        got = [brute_batch([made[i][0] for i in members], every, first, s) for members in spread(len(made), batch)]
        served, copied, nreads, picks = (sum(x) for x in zip(*got))
        assert curves.hits[s - 1] == pytest.approx(served / nreads, abs=1e-6)
        assert curves.copies[s - 1] == pytest.approx(copied / (picks / k), abs=1e-6)


def test_a_batch_spreads_over_the_prompt_list():
    assert spread(7, 2) == [[0, 3], [1, 4], [2, 5]] and spread(8, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert spread(3, 1) == [[0], [1], [2]] and spread(3, 4) == []


def test_a_batch_that_keeps_to_different_experts_is_served_less():
    """Two conversations, each always on its own two experts: two rows serve each alone fully,
    the pair together half of its reads (four experts read a step)."""
    def conv(hot):
        steps = torch.zeros(24, 8, dtype=torch.uint8)
        steps[:, list(hot)] = 1
        prompt = torch.zeros(8, dtype=torch.int64)
        prompt[list(hot)] = 4
        return {1: (prompt, steps)}

    a, b = conv((0, 1)), conv((4, 5))
    alone = cache_curves([a], 2, intervals=(8,))[8][1]
    both = cache_curves([a, b], 2, 2, intervals=(8,))[8][1]
    assert alone.hits[1] == 1.0 and both.hits[1] == 0.5 and both.hits[3] == 1.0


def test_sticky_routing_is_served_and_shifting_routing_is_not():
    experts = 16

    def conv(hot_per_block):
        """The prompt picks the first pair, then each 8 decode steps the next pair."""
        prompt = torch.zeros(experts, dtype=torch.int64)
        prompt[list(hot_per_block[0])] = 8
        steps = torch.zeros(8 * (len(hot_per_block) - 1), experts, dtype=torch.uint8)
        for i, hot in enumerate(hot_per_block[1:]):
            steps[8 * i:8 * (i + 1), list(hot)] = 1
        return {1: (prompt, steps)}

    sticky = conv([(0, 1)] * 9)  # the same two experts every 8 steps
    moving = conv([(2 * i % experts, (2 * i + 1) % experts) for i in range(9)])  # two new experts every 8 steps
    c = cache_curves([sticky], 2, intervals=(8,))[8][1]
    assert c.hits[1] == 1.0 and c.copies[1] == 0.0  # two rows serve every pick; nothing copied after the prompt
    m = cache_curves([moving], 2, intervals=(8,))[8][1]
    assert m.hits[1] == 0.0 and m.copies[1] > 0  # last stretch's experts never come back


def test_an_interval_below_one_token_is_refused():
    with pytest.raises(ValueError, match="whole number of decoded tokens"):
        cache_curves([{1: (torch.ones(4, dtype=torch.int64), torch.ones(3, 4, dtype=torch.uint8))}], 1, intervals=(0,))
