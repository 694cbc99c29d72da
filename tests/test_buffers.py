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
    by_arena = {}
    for b in plan.buffers:
        by_arena.setdefault(b.arena, []).append(b)
        assert b.offset % 256 == 0 and b.offset + b.bytes <= plan.arenas[b.arena]
    for bufs in by_arena.values():
        for i, a in enumerate(bufs):
            for b in bufs[i + 1:]:
                if a.first_step <= b.last_step and b.first_step <= a.last_step:
                    assert a.offset + a.bytes <= b.offset or b.offset + b.bytes <= a.offset, (a, b)


def test_arenas_reuse_memory_across_layers(hybrid):
    plan = hybrid.decode
    total = sum(b.bytes for b in plan.buffers)
    assert sum(plan.arenas.values()) < total / 2  # liveness reuse, not one slot per value
    pinned = {b.value for b in plan.buffers if b.arena == "pinned"}
    assert "L2.experts" in pinned and "L2.ffn_norm.to_cpu" in pinned  # what crosses PCIe on the host side
    assert not any(b.value.endswith(".sync") for b in plan.buffers)  # a sync aliases its task's buffer
    task = next(b for b in plan.buffers if b.value == "L2.experts")
    copy_step = next(i for i, s in enumerate(plan.steps) if s.node == "L2.experts.to_gpu" and s.kind == "copy")
    assert task.last_step >= copy_step  # live until the copy has read it
    g = plan.ir
    for b in plan.buffers:  # unpinned buffers live on their node's device
        if b.arena != "pinned":
            assert b.arena == ("gpu" if g.by_name(b.value).place.device.value == "gpu" else "host"), b


def test_events_pair_writers_with_readers_on_other_lanes(hybrid):
    steps = hybrid.decode.steps
    records = {s.event: i for i, s in enumerate(steps) if s.kind == "record"}
    waits = {s.event: i for i, s in enumerate(steps) if s.kind == "wait"}
    assert records and set(records) == set(waits)
    for ev, i in waits.items():
        assert records[ev] < i
    # the GPU stream waits on the CPU task's result before the sync hands it over
    assert "L2.experts>gpu" in waits
    lane_of = {s.node: s.lane for s in steps if s.kind not in ("record", "wait")}
    for s in steps:
        if s.kind in ("launch", "copy", "submit", "sync"):
            for r in s.reads:
                if lane_of.get(r, s.lane) != s.lane:
                    assert f"{r}>{s.lane}" in waits


def test_capture_regions(hybrid, demo_dir):
    assert hybrid.decode.capture == [(0, len(hybrid.decode.steps) - 1)]  # the whole decode step, one graph
    assert all(p.capture == [] for p in hybrid.prefill)  # prefill runs eagerly
    cpu_only = ktflow.compile(ktflow.load(demo_dir), hw="cpu")
    assert cpu_only.decode.capture == [] and not any(s.kind in ("record", "wait") for s in cpu_only.decode.steps)


def test_cpu_task_values_live_from_submit_to_sync(hybrid):
    """The CPU runs a task asynchronously between its submit and its sync: its inputs (the
    exchange buffer the GPU copied into) must not be reused before the sync, nor may its output
    share bytes with anything written after the submit (a deferred task's sync is a layer later)."""
    plan = hybrid.decode
    g = plan.ir
    at = {(s.kind, s.node): i for i, s in enumerate(plan.steps)}
    buf = {b.value: b for b in plan.buffers}
    sync_of = {n.inputs[1]: n.name for n in g.nodes if n.op.value == "sync"}
    checked = 0
    for sub in (n for n in g.nodes if n.op.value == "submit"):
        s0 = at[("submit", sub.name)]
        s1 = max(at[("sync", sync_of[m])] for m in sub.attrs.members if m in sync_of)
        for m in sub.attrs.members:
            if m in buf:
                assert buf[m].first_step <= s0, m
            for i in g.by_name(m).inputs:
                if i in buf:
                    assert buf[i].last_step >= s1, (m, i)
                    checked += 1
    assert checked and any(n.name.endswith(".def") for n in g.nodes)
