"""Static buffer plan, events and capture regions of the schedule."""

import pytest

import ktflow


@pytest.fixture(scope="module")
def hybrid(demo_dir):
    return ktflow.compile(ktflow.load(demo_dir), hw="paper-a100", vram_budget_gb=0.004, defer=1)


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_values_live_at_once_never_share_bytes(hybrid, which):
    for plan in (hybrid.prefill if which == "prefill" else [hybrid.decode]):
        _no_overlap(plan)


def _no_overlap(plan):
    """Checked by hand (not by the verifier the pass is held to), at the plan's step size and at
    other sizes: the per-token layout serves every step size."""
    for tokens in (plan.step_tokens, 1, 3, 4 * plan.step_tokens):
        arenas = plan.arena_bytes(tokens)
        by_arena = {}
        for value, b in plan.buffers.items():
            offset, size = b.span(tokens)
            by_arena.setdefault(b.arena, []).append((offset, size, b.first_instruction, b.last_instruction, value))
            if b.per_token:
                assert offset % (64 * tokens) == 0 and size >= plan.ir.by_name(value).out.numel(tokens) * \
                    plan.ir.by_name(value).out.dtype.itemsize
            assert offset + size <= arenas[b.arena]
        for bufs in by_arena.values():
            for i, (o1, n1, f1, l1, v1) in enumerate(bufs):
                for o2, n2, f2, l2, v2 in bufs[i + 1:]:
                    if f1 <= l2 and f2 <= l1:
                        assert o1 + n1 <= o2 or o2 + n2 <= o1, (v1, v2, tokens)


def test_the_buffer_plan_is_a_verified_pass(hybrid):
    """The buffer pass ends the pipeline: the graph's nodes carry their buffers, the plan reads them
    there, and the verifier's buffer rules hold the pass (an overlap is caught, naming B2)."""
    from dataclasses import replace

    from ktflow.ir.verify import VerifyError, verify
    from ktflow.passes import pass_names

    assert pass_names()[-2:] == ["schedule", "plan_buffers"]
    plan = hybrid.decode
    g = plan.ir
    assert set(plan.buffers) == {n.name for n in g.nodes if n.buffer is not None}
    verify(g, "buffered")
    pinned = [n for n in g.nodes if n.buffer is not None and n.buffer.arena == "pinned"]
    a, b = next((a, b) for a in pinned for b in pinned if a.name < b.name  # two exchange values live at once
                and a.buffer.first_instruction <= b.buffer.last_instruction
                and b.buffer.first_instruction <= a.buffer.last_instruction)
    moved = replace(b, buffer=replace(b.buffer, offset=a.buffer.offset))
    with pytest.raises(VerifyError, match="B2"):
        verify(g.replace_nodes(moved if n.name == b.name else n for n in g.nodes), "buffered")
    with pytest.raises(VerifyError, match="B1"):
        verify(g.replace_nodes(replace(n, buffer=None) if n.name == a.name else n for n in g.nodes), "buffered")


def test_a_larger_batch_scales_the_arenas(hybrid):
    """The layout is per token: a decode batch of 4 needs 4x the exchange memory of one token."""
    plan = hybrid.decode
    assert plan.step_tokens == 1
    one, four = plan.arena_bytes(1), plan.arena_bytes(4)
    assert four["pinned"] == 4 * one["pinned"] and four["gpu"] == 4 * one["gpu"]


def test_arenas_reuse_memory_across_layers(hybrid):
    plan = hybrid.decode
    total = sum(b.bytes for b in plan.buffers.values())
    assert sum(plan.arena_bytes().values()) < total / 2  # liveness reuse, not one buffer per value
    pinned = {v for v, b in plan.buffers.items() if b.arena == "pinned"}
    assert "L2.experts" in pinned and "L2.ffn_norm.to_cpu" in pinned  # what crosses PCIe on the host side
    assert not any(v.endswith(".sync") for v in plan.buffers)  # a sync aliases its task's buffer
    task = plan.buffers["L2.experts"]
    copy_at = next(i for i, s in enumerate(plan.instructions) if s.node == "L2.experts.to_gpu" and s.kind == "copy")
    assert task.last_instruction >= copy_at  # live until the copy has read it
    g = plan.ir
    for v, b in plan.buffers.items():  # unpinned buffers live on their node's device
        if b.arena != "pinned":
            assert b.arena == ("gpu" if g.by_name(v).place.device.value == "gpu" else "host"), b


def test_events_pair_writers_with_readers_on_other_lanes(hybrid):
    instrs = hybrid.decode.instructions
    records = {s.event: i for i, s in enumerate(instrs) if s.kind == "record"}
    waits = {s.event: i for i, s in enumerate(instrs) if s.kind == "wait"}
    assert records and set(records) == set(waits)
    for ev, i in waits.items():
        assert records[ev] < i
    # the GPU stream waits on the CPU task's result before the sync hands it over
    assert "L2.experts>gpu" in waits
    lane_of = {s.node: s.lane for s in instrs if s.kind not in ("record", "wait")}
    for s in instrs:
        if s.kind in ("launch", "copy", "submit", "sync"):
            for r in s.reads:
                if lane_of.get(r, s.lane) != s.lane:
                    assert f"{r}>{s.lane}" in waits


def test_capture_regions(hybrid, demo_dir):
    assert hybrid.decode.capture == [(0, len(hybrid.decode.instructions) - 1)]  # the whole decode step, one graph
    assert all(p.capture == [] for p in hybrid.prefill)  # prefill runs eagerly
    cpu_only = ktflow.compile(ktflow.load(demo_dir), hw="cpu")
    assert cpu_only.decode.capture == [] and not any(s.kind in ("record", "wait") for s in cpu_only.decode.instructions)


def test_cpu_task_values_live_from_submit_to_sync(hybrid):
    """The CPU runs a task asynchronously between its submit and its sync: its inputs (the
    exchange buffer the GPU copied into) must not be reused before the sync, nor may its output
    share bytes with anything written after the submit (a deferred task's sync is a layer later)."""
    plan = hybrid.decode
    g = plan.ir
    at = {(s.kind, s.node): i for i, s in enumerate(plan.instructions)}
    buf = plan.buffers
    sync_of = {n.inputs[1]: n.name for n in g.nodes if n.op.value == "sync"}
    checked = 0
    for sub in (n for n in g.nodes if n.op.value == "submit"):
        s0 = at[("submit", sub.name)]
        s1 = max(at[("sync", sync_of[m])] for m in sub.attrs.members if m in sync_of)
        for m in sub.attrs.members:
            if m in buf:
                assert buf[m].first_instruction <= s0, m
            for i in g.by_name(m).inputs:
                if i in buf:
                    assert buf[i].last_instruction >= s1, (m, i)
                    checked += 1
    assert checked and any(n.name.endswith(".def") for n in g.nodes)
