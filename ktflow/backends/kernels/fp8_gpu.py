"""Linear layers over block-scaled FP8 weights held as the checkpoint stores them.

An `Fp8Weight` (a weight with `WeightRef.held == "fp8"`) is the release's e4m3 bytes [n, k] and
float32 block scales [ceil(n / 128), ceil(k / 128)]; routed experts are one per projection over the
node's stack (data [E, n, k], scales [E, ceil(n / 128), ceil(k / 128)]). `linear(x, w)` computes
x @ (w8 * scale)^T with activations in bf16/fp16 and float32 accumulation: on a CUDA device with
Triton, up to memory.FP8_FUSED_ROWS rows in one kernel that builds no dequantized matrix, more rows
through a dequantized temporary and cuBLAS; elsewhere the dequantized matrix and `F.linear`, the
reference the kernels are tested against. Experts: `picked_linear` (each pick's bytes read once,
where `picks_fused`) or `dequantize_experts` (one projection at a time). Temporaries are those
memory.py counts (`fp8_dequant_bytes`, `fp8_experts_dequant_bytes`). Only 128 x 128 blocks are held
in FP8; the placement pass dequantizes other block sizes at load. The kernels: docs/design-notes.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...ir.types import FP8_BLOCK as BLOCK  # the scale block, both ways: the kernel's k step
from ...costmodel.memory import FP8_FUSED_ROWS
from ...frontend.quant import dequantize
from .dequant_gpu import available as triton_on  # CUDA, Triton importable


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight on its device: `data` [n, k] float8_e4m3fn, `scale_inv` [ceil(n/128),
    ceil(k/128)] float32 (the real weight is data * scale_inv per block); or a stack of routed
    experts' matrices, data [E, n, k] and scale_inv [E, ceil(n/128), ceil(k/128)]
    (`dequantize_experts`)."""

    data: torch.Tensor
    scale_inv: torch.Tensor

    def nbytes(self) -> int:
        return self.data.numel() + self.scale_inv.numel() * self.scale_inv.element_size()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.data, self.scale_inv, (BLOCK, BLOCK)).to(dtype)


def dequantize_experts(w: Fp8Weight, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A stack of FP8 expert matrices (`w.data` [E, n, k]) in `dtype`: the stack's rows `rows`
    (int64 on its device: the picked experts, their bytes and scales gathered first) or all of
    them -> [len(rows) or E, n, k]. Each weight is rounded once from its float32 product with its
    block scale, as `Fp8Weight.dequantized`. Plain torch ops with static shapes and no host sync
    (a CUDA graph captures it), the scales broadcast over a blocked view (no expanded copy); a
    matrix of partial blocks is padded to whole ones (the result a view of it). The whole stack on
    a CUDA device with Triton, n a multiple of the block: one pass of `fp8_dequant` over it."""
    data, scale = w.data, w.scale_inv
    e, n, k = data.shape
    nb, kb = scale.shape[1:]
    if rows is None and n % BLOCK == 0 and triton_on(data.device) and dtype in (torch.bfloat16, torch.float16):
        flat = Fp8Weight(data.view(e * n, k), scale.reshape(e * nb, kb))
        return dequantize_gpu(flat, dtype).view(e, n, k)
    if rows is not None:  # the picked rows' bytes (gathered as bytes: any device's index_select takes them)
        data = data.view(torch.uint8).index_select(0, rows).view(torch.float8_e4m3fn)
        scale = scale.index_select(0, rows)
        e = rows.shape[0]
    values = data.view(torch.float8_e4m3fn)
    if (n, k) == (nb * BLOCK, kb * BLOCK):
        full = out = values.to(dtype)
    else:
        full = torch.zeros(e, nb * BLOCK, kb * BLOCK, dtype=dtype, device=data.device)
        out = full[:, :n, :k]
        out.copy_(values)
    del data, values
    # in place: the product of the (exact) value and the float32 scale is rounded once, to dtype
    full.view(e, nb, BLOCK, kb, BLOCK).mul_(scale[:, :, None, :, None])
    return out


def stack_rows(w) -> int:
    """Experts in a stacked projection: a tensor [E, n, k] or an Fp8Weight over one."""
    return (w.data if isinstance(w, Fp8Weight) else w).shape[0]


def nan_bytes(w8: torch.Tensor) -> torch.Tensor:
    """Where an e4m3 tensor holds NaN (0x7F / 0xFF: e4m3fn has no infinities)."""
    return (w8.view(torch.uint8) & 0x7F) == 0x7F


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def widen(raw):  # e4m3 bytes (int16) -> binary16 holding value * 2^-8, exactly
        return (((raw & 0x7F) << 7) | ((raw & 0x80) << 8)).to(tl.float16, bitcast=True)

    @triton.jit
    def fp8_gemm(x, w, s, bias, y, m, n, k, sx, sw, ss, sy, has_bias: tl.constexpr,
                 bm: tl.constexpr, bn: tl.constexpr, bk: tl.constexpr):
        """A [bm, bn] output tile per program, k in steps of one 128-wide scale block (bk)."""
        pn = tl.program_id(0)
        pm = tl.program_id(1)
        rm = pm * bm + tl.arange(0, bm)
        rn = pn * bn + tl.arange(0, bn)
        rk = tl.arange(0, bk)
        acc = tl.zeros((bm, bn), dtype=tl.float32)
        for k0 in range(0, k, bk):
            kk = k0 + rk
            a = tl.load(x + rm[:, None].to(tl.int64) * sx + kk[None, :], mask=(rm[:, None] < m) & (kk[None, :] < k),
                        other=0.0)
            raw = tl.load(w + rn[None, :].to(tl.int64) * sw + kk[:, None], mask=(rn[None, :] < n) & (kk[:, None] < k),
                          other=0).to(tl.int16)  # [bk, bn]
            sc = tl.load(s + (rn // bk) * ss + k0 // bk, mask=rn < n, other=0.0)
            acc += tl.dot(a, widen(raw).to(a.dtype)) * (sc * 256.0)[None, :]
        if has_bias:
            acc += tl.load(bias + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
        dst = y + rm[:, None].to(tl.int64) * sy + rn[None, :]
        tl.store(dst, acc.to(y.dtype.element_ty), mask=(rm[:, None] < m) & (rn[None, :] < n))

    @triton.jit
    def fp8_dequant(w, s, out, n, k, sw, ss, so, bn: tl.constexpr, bk: tl.constexpr, block: tl.constexpr):
        """out [n, k] = w * its block scale, in out's dtype: one [bn, bk] tile per program."""
        rn = tl.program_id(0) * bn + tl.arange(0, bn)
        kk = tl.program_id(1) * bk + tl.arange(0, bk)
        inside = (rn[:, None] < n) & (kk[None, :] < k)
        raw = tl.load(w + rn[:, None].to(tl.int64) * sw + kk[None, :], mask=inside, other=0).to(tl.int16)
        sc = tl.load(s + (rn[:, None] // block) * ss + kk[None, :] // block, mask=inside, other=0.0)
        val = widen(raw).to(tl.float32) * (sc * 256.0)
        tl.store(out + rn[:, None].to(tl.int64) * so + kk[None, :], val.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def fp8_pick_gemv(x, xdiv, w, s, stack_rows, y, n, k, sx, swe, swn, sse, ssn, sy, bn: tl.constexpr, bk: tl.constexpr):
        """y[r] = x[r // xdiv] @ (the matrix in stack row stack_rows[r])^T for one [bn] slice of row r per
        program, k in steps of one scale block (bk); each weight rounded to y's dtype after its
        scale (what a dequantized matrix holds), the products summed in float32."""
        pn = tl.program_id(0)
        r = tl.program_id(1)
        e = tl.load(stack_rows + r).to(tl.int64)
        rn = pn * bn + tl.arange(0, bn)
        rk = tl.arange(0, bk)
        xrow = x + (r // xdiv).to(tl.int64) * sx
        wrow = w + e * swe + rn[:, None].to(tl.int64) * swn
        acc = tl.zeros((bn,), dtype=tl.float32)
        for k0 in range(0, k, bk):
            kk = k0 + rk
            a = tl.load(xrow + kk, mask=kk < k, other=0.0).to(tl.float32)
            raw = tl.load(wrow + kk[None, :], mask=(rn[:, None] < n) & (kk[None, :] < k), other=0).to(tl.int16)
            sc = tl.load(s + e * sse + (rn // bk) * ssn + k0 // bk, mask=rn < n, other=0.0)
            wd = widen(raw).to(tl.float32) * (sc * 256.0)[:, None]
            wd = wd.to(y.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
            acc += tl.sum(wd * a[None, :], axis=1)
        tl.store(y + r.to(tl.int64) * sy + rn, acc.to(y.dtype.element_ty), mask=rn < n)

    return triton, fp8_gemm, fp8_dequant, fp8_pick_gemv


def linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ (w.data * w.scale_inv)^T (+ bias) -> [..., n] in x's dtype."""
    if not (triton_on(x.device) and x.dtype in (torch.bfloat16, torch.float16)):
        return F.linear(x, w.dequantized(x.dtype), bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > FP8_FUSED_ROWS:  # memory.py counts this temporary
        return F.linear(x, dequantize_gpu(w, x.dtype), bias)
    return fused(x2, w, bias).view(*lead, w.data.shape[0])


def fused(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel on x [m, k] (bf16/fp16; m <= FP8_FUSED_ROWS): [m, n]."""
    triton, gemm, *_ = _kernels()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.data.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (x, w.data.view(torch.uint8), w.scale_inv, bias if bias is not None else y, y, m, n, k,
            x.stride(0), w.data.stride(0), w.scale_inv.stride(0), y.stride(0), bias is not None)
    if m:  # thin tiles: n / 32 programs stream the weight
        gemm[(triton.cdiv(n, 32), triton.cdiv(m, 16))](*args, 16, 32, BLOCK, num_warps=4, num_stages=4)
    return y


def dequantize_gpu(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [n, k] in `dtype`, in one pass of a kernel (a temporary for large products)."""
    triton, _, kernel, _ = _kernels()
    n, k = w.data.shape
    out = torch.empty(n, k, dtype=dtype, device=w.data.device)
    kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](w.data.view(torch.uint8), w.scale_inv, out, n, k,
                                                        w.data.stride(0), w.scale_inv.stride(0), out.stride(0),
                                                        32, 256, BLOCK, num_warps=4)
    return out


def picks_fused(x: torch.Tensor) -> bool:
    """Whether `picked_linear` runs for activations `x`: CUDA with Triton, bf16 or fp16."""
    return triton_on(x.device) and x.dtype in (torch.bfloat16, torch.float16)


def picked_linear(x: torch.Tensor, w: Fp8Weight, stack_rows: torch.Tensor, xdiv: int) -> torch.Tensor:
    """Row r: x[r // xdiv] [k] times the matrix in row `stack_rows[r]` of the FP8 stack `w` (data
    [E, n, k]) -> [len(stack_rows), n] in x's dtype, in one kernel (`fp8_pick_gemv`) that reads each
    picked expert's bytes once and builds no dequantized matrix (`picks_fused(x)` must hold).
    Equal to `dequantize_experts(w, x.dtype, stack_rows)` multiplied in float32, up to the order of
    the sums; static shapes and no host sync (a CUDA graph captures it)."""
    triton, *_, gemv = _kernels()
    e, n, k = w.data.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    data, scale = w.data.view(torch.uint8), w.scale_inv
    if data.stride(2) != 1 or scale.stride(2) != 1:
        raise ValueError("picked_linear: the FP8 stack's rows must be contiguous")
    rows = stack_rows.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:  # a program per 16 output rows of a pick (tile and warps: benchmarks/fp8_experts_decode.py)
        gemv[(triton.cdiv(n, 16), rows)](x, xdiv, data, scale, stack_rows, y, n, k, x.stride(0), data.stride(0),
                                         data.stride(1), scale.stride(0), scale.stride(1), y.stride(0), 16, BLOCK,
                                         num_warps=8 if k > 1024 else 2)
    return y
