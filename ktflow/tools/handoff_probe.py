"""The CPU task hand-off, measured directly (`ktflow hw probe`, GPU machines with the native module).

A decode layer's CPU experts cost their work plus a fixed hand-off: inside the replayed CUDA graph
the stream clears a batch's done flag and writes its doorbell (two stream memory operations), the
native dispatcher, polling the armed ring, sees the doorbell and runs the batch on the pool, sets
the done flag, and the stream's wait on that flag (a wait-value node) lets the next kernel start.
`round_trip_us` times exactly that path with empty batches (no expert work): a captured graph of
`n` small kernels each followed by a hand-off, against the same graph without the hand-offs, per
round trip. The cost model prices the round trip as `overheads.cpu_submit_us +
overheads.cpu_sync_us`; the probe does not split it between the two ends.
"""

from __future__ import annotations

import time

import torch


def round_trip_us(n: int = 32, reps: int = 5) -> float | None:
    """Median us one hand-off round trip adds to a replayed graph (at least 7 alternating pairs of
    replays, with and without the hand-offs); None where this machine cannot run it (no CUDA, no
    native module, or no stream memory operations)."""
    from ..backends.native import binding as native
    from ..backends.cuda.backend import Driver

    if not torch.cuda.is_available() or not native.available():
        return None
    driver = Driver()
    if not (driver.can_write_value() and driver.can_wait_value()):
        return None
    q = native.queue()
    words = torch.zeros(2 * n, dtype=torch.int32, pin_memory=True)  # (done flag, doorbell) per batch
    batches = [native.Batch(q) for _ in range(n)]
    for i, b in enumerate(batches):
        b.set_done_flag(words[2 * i:2 * i + 1])
        b.set_doorbell(words[2 * i + 1:2 * i + 2])
    ring = native.Ring(batches)
    base = driver.device_address(words)
    x = torch.zeros(256, device="cuda")
    stream = torch.cuda.Stream()

    def capture(handoffs: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(n):
                x.add_(1)
                if handoffs:
                    driver.write_value(stream, base + 8 * i, 0)
                    driver.write_value(stream, base + 8 * i + 4, 1)
                    driver.wait_value(stream, base + 8 * i, 1)
        return graph

    def replay_us(graph: torch.cuda.CUDAGraph, armed: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if armed:
            ring.arm()
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        took = (time.perf_counter() - t0) * 1e6
        if armed:
            native.sync()
        return took

    plain, with_handoffs = capture(False), capture(True)
    replay_us(plain, False), replay_us(with_handoffs, True)  # warm up
    # the two graphs alternate, so that a burst of other work on the host (a checkpoint's write-back,
    # a thread waking) falls on a pair rather than on one side; the median pair's difference
    diffs = sorted(replay_us(with_handoffs, True) - replay_us(plain, False) for _ in range(max(reps, 7)))
    return max(diffs[len(diffs) // 2] / n, 0.0)
