"""The asynchronous queue: many submits, errors at sync, the C entry points a CUDA stream calls,
and shutdown with work pending."""

import ctypes
import subprocess
import sys
import time

import pytest
import torch

from ktflow.backends.native import binding as native
from ktflow.errors import KtflowError
from test_native_kernels import make_experts, reference_moe, rel, routing

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")


@pytest.fixture(scope="module")
def op():
    E, H, I = 8, 64, 48
    gate, up, down = make_experts(E, H, I, seed=2)
    o = native.ExpertOp(E, H, I)
    o.pack(lambda e: (gate[e], up[e], down[e]))
    o.ref = (gate, up, down)
    return o


def test_many_submits_then_one_sync(op):
    x = torch.randn(5, 64).bfloat16()
    ids, wts = routing(5, 8, 2, seed=0)
    outs = [torch.zeros(5, 64) for _ in range(4)]
    batches = []
    for o in outs:
        b = native.Batch()
        b.add(op, x, ids, wts, o, accumulate=True)
        batches.append(b)
    for _ in range(100):
        for b in batches:
            b.submit()
    native.sync()
    ref = reference_moe(x, ids, wts, *op.ref, set(range(8)), (0, 2))
    for o in outs:
        assert rel(o / 100, ref) < 1e-2


def test_worker_error_surfaces_at_sync_and_the_queue_goes_on(op):
    x = torch.randn(2, 64).bfloat16()
    ids, wts = routing(2, 8, 2, seed=1)
    bad = ids.clone()
    bad[1, 1] = 42
    out = torch.zeros(2, 64)
    b_bad, b_good = native.Batch(), native.Batch()
    b_bad.add(op, x, bad, wts, out)
    b_good.add(op, x, ids, wts, out)
    b_bad.submit()  # returns at once: the error is only known when the batch runs
    with pytest.raises(KtflowError, match="expert id 42 at token 1"):
        native.sync()
    b_good.submit()
    native.sync()  # nothing left over from the failure
    assert rel(out, reference_moe(x, ids, wts, *op.ref, set(range(8)), (0, 2))) < 1e-2


def test_c_entry_points_drive_the_queue(op):
    """ktf_submit(batch) and ktf_sync(queue) as plain C functions (what cudaLaunchHostFunc calls),
    with the token count read from a buffer at run time."""
    x = torch.randn(6, 64).bfloat16()
    ids, wts = routing(6, 8, 3, seed=3)
    out = torch.zeros(6, 64)
    tokens = torch.tensor([4], dtype=torch.int32)
    b = native.Batch()
    b.add(op, x, ids, wts, out, tokens=tokens)
    fns = native.c_entry_points()
    submit = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fns["submit"])
    wait = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fns["sync"])
    submit(b.handle)
    wait(fns["queue"])
    ref = reference_moe(x, ids, wts, *op.ref, set(range(8)), (0, 3))
    assert rel(out[:4], ref[:4]) < 1e-2 and not out[4:].any()  # only the first 4 tokens ran
    tokens[0] = 6
    submit(b.handle)
    wait(fns["queue"])
    assert rel(out, ref) < 1e-2
    wait_batch = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fns["wait_batch"])
    out.zero_()
    submit(b.handle)
    wait_batch(b.handle)  # what a captured graph's sync node calls: this batch, not the whole queue
    assert rel(out, ref) < 1e-2
    native.sync()


def test_exit_with_work_pending_does_not_hang():
    code = """
import torch
from ktflow.backends.native import binding as native
from test_native_kernels import make_experts, routing
gate, up, down = make_experts(8, 256, 128, seed=0)
op = native.ExpertOp(8, 256, 128)
op.pack(lambda e: (gate[e], up[e], down[e]))
x = torch.randn(64, 256).bfloat16()
ids, wts = routing(64, 8, 4, seed=0)
out = torch.zeros(64, 256)
b = native.Batch()
b.add(op, x, ids, wts, out, accumulate=True)
for _ in range(300):
    b.submit()
print("submitted")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(__import__("pathlib").Path(__file__).parent))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "submitted" in r.stdout


def test_one_operator_twice_in_a_batch_and_layers_sharing_scratch(op):
    """Jobs of one batch get their own scratch even on the same operator (a deferred rank range
    beside the immediate one), and operators of one pool (layers) share it without mixing results."""
    E, H, I = 8, 64, 48
    gate, up, down = op.ref
    other = native.ExpertOp(E, H, I)
    g2, u2, d2 = make_experts(E, H, I, seed=3)
    other.pack(lambda e: (g2[e], u2[e], d2[e]))
    x = torch.randn(300, H).bfloat16()
    ids, wts = routing(300, E, 4, seed=6)
    first, second = torch.zeros(300, H), torch.zeros(300, H)
    b = native.Batch()
    b.add(op, x, ids, wts, first, ranks=(0, 2))
    b.add(op, x, ids, wts, second, ranks=(2, 4))
    small = torch.zeros(3, H)
    b.add(other, x[:3], ids[:3], wts[:3], small)
    b.submit()
    native.sync()
    held = set(range(E))
    assert rel(first, reference_moe(x, ids, wts, gate, up, down, held, (0, 2))) < 1e-2
    assert rel(second, reference_moe(x, ids, wts, gate, up, down, held, (2, 4))) < 1e-2
    assert rel(small, reference_moe(x[:3], ids[:3], wts[:3], g2, u2, d2, held, (0, 4))) < 1e-2


def _wait_for_flag(flag, seconds=30.0):
    """Poll like a stream's wait-value node; fail (not hang) if the flag is never set."""
    deadline = time.monotonic() + seconds
    while int(flag[0]) != 1:
        assert time.monotonic() < deadline, "the done flag was never set"


def test_done_flag_is_cleared_at_submit_and_set_after_the_outputs(op):
    """The word a CUDA stream waits on (cuStreamWaitValue32): 0 from submit, 1 once the batch's
    outputs are written; a failed batch sets it too, so a waiting stream never hangs."""
    x = torch.randn(64, 64).bfloat16()
    ids, wts = routing(64, 8, 2, seed=4)
    out = torch.zeros(64, 64)
    flag = torch.full((1,), 7, dtype=torch.int32)
    b = native.Batch()
    b.add(op, x, ids, wts, out)
    b.set_done_flag(flag)
    ref = reference_moe(x, ids, wts, *op.ref, set(range(8)), (0, 2))
    for _ in range(20):
        out.zero_()
        b.submit()
        _wait_for_flag(flag)
        assert rel(out, ref) < 1e-2  # read before any sync: the flag alone orders it
    native.sync()
    bad = ids.clone()
    bad[0, 0] = 99
    b_bad = native.Batch()
    b_bad.add(op, x, bad, wts, out)
    b_bad.set_done_flag(flag)
    b_bad.submit()
    _wait_for_flag(flag)
    with pytest.raises(KtflowError, match="expert id 99"):
        native.sync()
    with pytest.raises(Exception, match="int32"):
        b.set_done_flag(torch.zeros(1, dtype=torch.int64))


def rung_ring(op, x, ids, wts, outs):
    """A ring of one batch per output (each adding the layer over x into it), with the doorbells
    and done flags (zeroed) a captured GPU step would ring and wait on; this thread plays the GPU."""
    bells, flags = torch.zeros(len(outs), dtype=torch.int32), torch.zeros(len(outs), dtype=torch.int32)
    batches = []
    for i, o in enumerate(outs):
        b = native.Batch()
        b.add(op, x, ids, wts, o, accumulate=True)
        b.set_doorbell(bells[i:i + 1])
        b.set_done_flag(flags[i:i + 1])
        batches.append(b)
    return native.Ring(batches), batches, bells, flags


def test_doorbells_submit_an_armed_ring_in_order(op):
    """A ring of batches submitted by doorbells, as a captured GPU step rings them (this thread
    plays the GPU: clear the done flag, ring, wait for the flag): each batch runs once per armed
    pass, in ring order, its doorbell cleared; a doorbell never rung ends the pass with an error at
    sync and releases the done flags after it, so a waiting GPU would go on."""
    import threading

    x = torch.randn(3, 64).bfloat16()
    ids, wts = routing(3, 8, 2, seed=4)
    outs = [torch.zeros(3, 64) for _ in range(3)]
    ring, batches, bells, flags = rung_ring(op, x, ids, wts, outs)
    flags.fill_(1)

    def gpu(upto=3):
        for i in range(upto):
            flags[i] = 0
            bells[i] = 1
            deadline = time.monotonic() + 10
            while int(flags[i]) != 1:
                assert time.monotonic() < deadline, f"batch {i} never ran"
    steps = 30
    for _ in range(steps):
        ring.arm()
        t = threading.Thread(target=gpu)
        t.start()
        t.join()
    native.sync()
    ref = reference_moe(x, ids, wts, *op.ref, set(range(8)), (0, 2))
    assert all(rel(o / steps, ref) < 1e-2 for o in outs)
    assert bells.tolist() == [0, 0, 0]
    starts = [b.native.timing[1] for b in batches]
    assert starts == sorted(starts)  # the last pass ran them in ring order
    native.queue().set_ring_timeout_ns(50_000_000)
    try:
        flags.zero_()  # as a step that has cleared them all would leave them
        ring.arm()
        gpu(upto=1)  # rings the first only
        deadline = time.monotonic() + 10
        while flags.tolist() != [1, 1, 1]:
            assert time.monotonic() < deadline, "the pass never ended"
        with pytest.raises(KtflowError, match="did not ring CPU task 1 of 3"):
            native.sync()
    finally:
        native.queue().set_ring_timeout_ns(30_000_000_000)


def test_disarm_ends_a_pass_without_an_error_and_drops_those_armed_after(op):
    """A step that fails after its ring was armed (three passes for a run of three steps) disarms
    it: the pass being polled ends at once with its done flags set, the passes after it are
    dropped, sync raises nothing, and the ring runs normally when armed again."""
    x = torch.randn(2, 64).bfloat16()
    ids, wts = routing(2, 8, 2, seed=5)
    out = torch.zeros(2, 64)
    ring, _, bells, flags = rung_ring(op, x, ids, wts, [out, out])
    for _ in range(3):
        ring.arm()
    bells[0] = 1  # the failed step rang its first task only
    deadline = time.monotonic() + 10
    while int(flags[0]) != 1:
        assert time.monotonic() < deadline, "the first task never ran"
    t0 = time.monotonic()
    ring.disarm()  # returns once the pass has ended
    assert int(flags[1]) == 1 and time.monotonic() - t0 < 5
    flags[1], bells[1] = 0, 1  # a GPU still running the failed work rings late: nothing runs it
    time.sleep(0.05)
    assert int(flags[1]) == 0
    native.sync()  # no error: the failure is the caller's to report
    once = out.clone()
    bells.zero_()  # as the caller clears them
    flags.zero_()
    ring.arm()
    bells[0], bells[1] = 1, 1
    deadline = time.monotonic() + 10
    while flags.tolist() != [1, 1]:
        assert time.monotonic() < deadline, "a dropped pass is still being polled, or the new one never ran"
    native.sync()
    assert torch.allclose(out, 3 * once, rtol=1e-3, atol=1e-3) and bells.tolist() == [0, 0]
    native.queue().set_ring_timeout_ns(50_000_000)
    try:  # a pass left armed would time out now and fail the sync
        time.sleep(0.3)
        native.sync()
    finally:
        native.queue().set_ring_timeout_ns(30_000_000_000)


def test_disarm_returns_only_when_no_batch_of_the_ring_can_run_any_more(op):
    """A disarm while the ring's doorbells are rung (the dispatcher may be taking the pass, running
    its first batch or about to see the second): once it returns nothing of that pass runs, rung
    or not (outputs and done flags stay as they are), whatever the timing (repeated)."""
    x = torch.randn(64, 64).bfloat16()  # enough tokens for a batch to take a while
    ids, wts = routing(64, 8, 2, seed=6)
    for trial in range(30):
        outs = [torch.zeros(64, 64) for _ in range(2)]
        ring, _, bells, flags = rung_ring(op, x, ids, wts, outs)
        ring.arm()
        bells[0] = 1
        bells[1] = 1
        if trial % 3:
            time.sleep(trial * 1e-4)  # let the dispatcher get into the pass
        ring.disarm()
        seen = [o.clone() for o in outs], flags.clone()
        time.sleep(0.03)
        assert all(torch.equal(o, c) for o, c in zip(outs, seen[0])) and torch.equal(flags, seen[1]), trial
        native.sync()


def test_an_idle_queue_and_pool_use_no_cpu(op):
    """After work, the dispatcher and the pool's workers spin briefly, then sleep: a loaded model
    with no requests costs (near) no CPU time."""
    x = torch.randn(4, 64).bfloat16()
    ids, wts = routing(4, 8, 2, seed=7)
    b = native.Batch()
    b.add(op, x, ids, wts, torch.zeros(4, 64))
    for _ in range(20):
        b.submit()
    native.sync()
    time.sleep(0.3)  # past every spin
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(0.5)
    busy = (time.process_time() - c0) / (time.monotonic() - t0)
    assert busy < 0.05, f"idle process used {busy:.0%} of a core"
