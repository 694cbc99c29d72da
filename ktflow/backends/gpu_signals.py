"""A captured step's doorbells and done-flag waits as one-thread kernels instead of stream memory
operations (the cuda_graph backend's wait="spin").

With wait="flag" a step rings each CPU task's doorbell with two `cuStreamWriteValue32` operations
(clear the done flag, set the doorbell) and waits for it with `cuStreamWaitValue32` on the done
flag. Measured on the GPU machine (H100), the Qwen3-shaped 12-layer decode graph replayed back to
back without the CPU runs 1252 us a replay, 1339 us with its doorbell writes, and with the waits
as well each replay is followed by a gap of about 650 us before the next one starts on the GPU
(benchmarks/RESULTS.md): a cost that lands on every decode step, outside the work.

Here both are kernels on the pinned words (mapped into the GPU's address space):
- `ring(flag, bell)`: stores 0 to the done flag (written through to host memory), then sets the
  doorbell with an atomic exchange of release semantics at system scope, so the CPU that sees the
  doorbell also sees the cleared flag and every store the stream made before this kernel;
- `wait(flag)`: one thread polls the done flag with volatile loads (each one a read of host
  memory, never a cached line) until the native dispatcher has set it, then ends; the kernels
  after it read the task's outputs from pinned memory with uncached loads (pinned_copy).
If a CPU task fails or is never rung, the native queue sets the done flags it leaves behind (the
ring's timeout), so a polling kernel ends as a stream wait would.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def ring(flag, bell):
        tl.store(flag, 0, cache_modifier=".wt")
        tl.atomic_xchg(bell, 1, sem="release", scope="sys")

    @triton.jit
    def wait(flag):
        seen = tl.load(flag, volatile=True)
        while seen == 0:
            seen = tl.load(flag, volatile=True)

    return ring, wait


def ring(flag: torch.Tensor, bell: torch.Tensor) -> None:
    """Clear the pinned int32 word `flag`, then set the pinned int32 word `bell` (current stream)."""
    kernel, _ = _kernels()
    kernel[(1,)](flag, bell, num_warps=1)


def wait(flag: torch.Tensor) -> None:
    """The stream waits until the pinned int32 word `flag` is non-zero (a polling kernel)."""
    _, kernel = _kernels()
    kernel[(1,)](flag, num_warps=1)
