"""Streaming packed experts to the GPU: the one stored copy in host memory (the native operators'
arenas) copied to a landing buffer on the device, then unpacked there into a fetch's output.

A layer's packed experts may be held by several operators (NUMA shards, each with intermediate
rows i0..i1) and each operator by slices; every (operator, slice) piece is one page-aligned
arena with the held experts in id order. `ExpertStager.stage` copies the requested experts of
every piece (one copy per run of consecutive experts), then converts each matrix to the plain
[n, k] layout of the fetch output: gate and up [inter, hidden], down [hidden, inter] per expert.
On CUDA the arenas are pinned once (`pin`), so the copies run at PCIe speed without staging.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import binding as native
from ...errors import KtflowError
from ..kernels.moe_gpu import unpack_matrix
from ..base import staged


@dataclass(frozen=True)
class Piece:
    op: native.ExpertOp
    slice: int
    rows: tuple[int, int]  # the layer's intermediate rows this piece holds
    stride: int  # bytes between two experts' blocks in the piece's arena


def pieces_of(ops: list[native.ExpertOp], row_offsets: list[int]) -> list[Piece]:
    """Every slice of every operator, with its rows in the layer (operator i starts at row
    row_offsets[i] of the layer's intermediate dimension)."""
    out = []
    for op, base in zip(ops, row_offsets, strict=True):
        for i, (i0, i1, _, _) in enumerate(op.slices):
            out.append(Piece(op, i, (base + i0, base + i1), op.expert_stride(i)))
    return sorted(out, key=lambda p: p.rows)


def _runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first block, length) of each run of consecutive blocks."""
    out: list[list[int]] = []
    for i, s in enumerate(blocks):
        if out and s == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([i, s, 1])
    return [tuple(r) for r in out]  # type: ignore[misc]


class ExpertStager:
    """Stages experts of one layer held by `pieces` (packed as `fmt`) on `device`."""

    def __init__(self, pieces: list[Piece], fmt: str, hidden: int, inter: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16):
        edges = [p.rows for p in pieces]
        if not pieces or edges[0][0] != 0 or edges[-1][1] != inter or any(a[1] != b[0] for a, b in zip(edges, edges[1:])):
            raise KtflowError(f"the packed experts' rows {edges} do not tile the layer's {inter} intermediate rows")
        self.pieces, self.fmt, self.hidden, self.inter, self.device = pieces, fmt, hidden, inter, device
        self.dtype = dtype
        # what every step reads, looked up once: each piece's arena view and matrix layouts, and the
        # runs of consecutive arena blocks a subset copies (a fetch stages the same subset each step)
        self._arenas = [p.op.arena(p.slice) for p in pieces]
        self._layouts = [[p.op.layout(p.slice, which) for which in range(3)] for p in pieces]
        self._runs: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}

    def page_lock(self) -> bool:
        """Page-lock every piece's packed experts (copies from them then run asynchronously);
        False where the driver would not lock some piece."""
        return all([pin(p.op) for p in self.pieces])

    def landing_bytes(self, experts: int) -> int:
        """Bytes of the landing buffer for `experts` experts (every piece's blocks back to back)."""
        return experts * sum(p.stride for p in self.pieces)

    def stage(self, subset: tuple[int, ...], out: torch.Tensor | None = None,
              landing: torch.Tensor | None = None, remember: bool = True) -> torch.Tensor:
        """Copy experts `subset` to `landing` (uint8 on the device, at least landing_bytes; new
        when None) and unpack them into `out` [len(subset), 3 * hidden * inter] (new when
        None); returns `out`. Copies are asynchronous on the current stream where the arenas
        are pinned. `remember`: keep the subset's copy runs for the next call (a fetch stages the
        same subset every step; a cache's refills stage ever new ones, so it passes False)."""
        n = len(subset)
        if out is None:
            out = torch.empty(n, 3 * self.hidden * self.inter, dtype=self.dtype, device=self.device)
        if landing is None:
            landing = torch.empty(self.landing_bytes(n), dtype=torch.uint8, device=self.device)
        gate, up, down = staged(out, self.hidden, self.inter)
        runs_per_piece = self._runs.get(subset)
        if runs_per_piece is None:
            runs_per_piece = [_runs([p.op.arena_block(e) for e in subset]) for p in self.pieces]
            if remember:
                self._runs[subset] = runs_per_piece
        at = 0
        for p, arena, layouts, runs in zip(self.pieces, self._arenas, self._layouts, runs_per_piece, strict=True):
            stride = p.stride
            dst = landing[at:at + n * stride].view(n, stride)
            at += n * stride
            for first, block, length in runs:
                dst[first:first + length].view(-1).copy_(arena[block * stride:(block + length) * stride], non_blocking=True)
            lo, hi = p.rows
            for L, target in zip(layouts, (gate[:, lo:hi], up[:, lo:hi], down[:, :, lo:hi]), strict=True):
                data = dst[:, L["data_offset"]:L["data_offset"] + L["data_bytes"]]
                scales = dst[:, L["scales_offset"]:L["scales_offset"] + L["scales_bytes"]] if L["scales_bytes"] else None
                unpack_matrix(self.fmt, data, scales, L["np"], L["kp"], L["group"], target)
        return out


#: memory page-locked here: address -> (bytes, the ids of the live owners leaning on it). Two owners
#: may share memory (a checkpoint's memory map read by two compiled plans: different tensors at one
#: address); it is unregistered when the last of them is freed.
_PINNED: dict[int, tuple[int, set[int]]] = {}
_REFUSED: set[tuple[int, int]] = set()  # (address, bytes) the driver would not register: not asked again


def _register(owner: object, address: int, nbytes: int) -> bool:
    """Page-lock [address, address + nbytes) for the GPU (cudaHostRegister) for as long as `owner`
    lives, counted with any other owner of the same memory. False where the driver refused, or
    where a shorter registration at that address is in use (not widened under its owners)."""
    entry = _PINNED.get(address)
    if entry is None:
        if (address, nbytes) in _REFUSED:
            return False
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(address, nbytes, 0)) != 0:
            cudart.cudaGetLastError()  # clear it: torch's next launch check would raise it
            _REFUSED.add((address, nbytes))
            return False
        entry = _PINNED[address] = (nbytes, set())
    elif entry[0] < nbytes:
        return False
    if id(owner) not in entry[1]:
        entry[1].add(id(owner))
        weakref.finalize(owner, _release, address, id(owner))
    return True


def _release(address: int, owner: int) -> None:
    entry = _PINNED.get(address)
    if entry is None:
        return
    entry[1].discard(owner)
    if not entry[1]:
        del _PINNED[address]
        try:
            torch.cuda.cudart().cudaHostUnregister(address)
        except Exception:  # noqa: BLE001 - exiting, or the context is gone: nothing to undo
            pass


def pin(op: native.ExpertOp) -> bool:
    """Page-lock an operator's arenas for the GPU while the operator lives. Returns False where the
    driver refused (copies then run from pageable memory, slower)."""
    ok = True
    for i in range(len(op.slices)):
        address, nbytes, _ = op.op.arena(i)
        ok = _register(op, address, nbytes) and ok
    return ok


def pin_tensor(t: torch.Tensor) -> bool:
    """Page-lock a contiguous CPU tensor's memory for the GPU while the tensor lives (with unified
    addressing a kernel then reads it at the tensor's own address). True where it is (memory
    allocated pinned included); False where the driver refused."""
    if t.is_cuda or not t.is_contiguous():
        return False
    if t.is_pinned() and t.data_ptr() not in _PINNED:  # allocated pinned, or registered elsewhere
        return True
    return _register(t, t.data_ptr(), t.numel() * t.element_size())
