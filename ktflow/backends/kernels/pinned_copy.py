"""Copies between GPU memory and pinned host memory as a kernel instead of a copy-engine memcpy
(cheaper as a node of a CUDA graph: docs/design-notes.md).

The kernel reads and writes pinned memory (cudaHostAlloc's, mapped at the same address) directly:
loads use `.cv` (fetched again every time: the CPU writes those buffers between reads), stores
`.wt` (written through to host memory); the CPU may read a stored buffer only after a later stream
operation says so (a doorbell write, a done flag, the host's wait for the step). `copy(dst, src)`
falls back to `dst.copy_(src, non_blocking=True)` where Triton is missing, the host side is not
pinned, either side is not contiguous, or the dtypes or element counts differ. Unlike a
non-blocking `copy_` it records no event with torch's pinned-memory cache: the pinned side must
outlive the copy. `gather_rows(out, table, ids)` gathers rows of a page-locked host table by ids
on the GPU, without the host.
"""

from __future__ import annotations

import functools

import torch

from . import dequant_gpu

_BLOCK = 1024


@functools.cache
def _triton(device_type: str) -> bool:
    """Whether the kernel runs for tensors on this device type (asked once: a failed Triton
    import is not cached by the module that tries it)."""
    return dequant_gpu.available(torch.device(device_type))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(src, dst, n, from_host: tl.constexpr, to_host: tl.constexpr, block: tl.constexpr):
        i = tl.program_id(0) * block + tl.arange(0, block)
        inside = i < n
        if from_host:
            v = tl.load(src + i, mask=inside, cache_modifier=".cv")
        else:
            v = tl.load(src + i, mask=inside)
        if to_host:
            tl.store(dst + i, v, mask=inside, cache_modifier=".wt")
        else:
            tl.store(dst + i, v, mask=inside)

    return triton, copy_words


def _word(*ts: torch.Tensor) -> torch.dtype:
    """The widest integer word that divides the tensors' bytes and their addresses."""
    nbytes = ts[0].numel() * ts[0].element_size()
    for dtype in (torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0 and all(t.data_ptr() % dtype.itemsize == 0 for t in ts):
            return dtype
    return torch.uint8


def _as(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).view(word)


def copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst <- src (the same number of elements; one of them pinned host memory, the other on the
    GPU), on the current stream; returns dst."""
    gpu, host = (src, dst) if src.is_cuda else (dst, src)
    if not (dst.dtype == src.dtype and dst.numel() == src.numel() and dst.is_contiguous() and src.is_contiguous()
            and _triton(gpu.device.type) and host.is_pinned()):
        return dst.copy_(src.view(dst.shape) if src.numel() == dst.numel() else src, non_blocking=True)
    if src.numel() == 0:
        return dst
    triton, kernel = _kernel()
    word = _word(src, dst)
    s, d = _as(src, word), _as(dst, word)
    n = s.numel()
    kernel[(triton.cdiv(n, _BLOCK),)](s, d, n, from_host=not src.is_cuda, to_host=not dst.is_cuda, block=_BLOCK)
    return dst


@functools.cache
def _gather_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows(table, ids, out, width, block: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1) * block + tl.arange(0, block)
        inside = c < width
        row = tl.load(ids + r).to(tl.int64)
        v = tl.load(table + row * width + c, mask=inside)
        tl.store(out + r * width + c, v, mask=inside, cache_modifier=".wt")

    return triton, gather_rows


def can_gather(table: torch.Tensor, out: torch.Tensor, pinned: bool = True) -> bool:
    """Whether gather_rows runs for this table (CPU, page-locked, contiguous) into `out` (pinned
    host or GPU memory, the table's dtype and row width); pinned=False: everything but the
    table's page-locking."""
    return (_triton("cuda") and not table.is_cuda and table.is_contiguous() and (table.is_pinned() or not pinned)
            and table.dim() == 2 and out.dtype == table.dtype and out.is_contiguous()
            and out.shape[-1] == table.shape[1] and (out.is_cuda or out.is_pinned()))


def gather_rows(out: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """out[i] <- table[ids[i]] on the current stream: `table` [rows, width] page-locked host memory
    (`can_gather`), `ids` int64 on the GPU, `out` [len(ids), width]; returns out."""
    triton, kernel = _gather_kernel()
    width = table.shape[1]
    kernel[(ids.numel(), triton.cdiv(width, _BLOCK))](table, ids, out, width, block=_BLOCK)
    return out
