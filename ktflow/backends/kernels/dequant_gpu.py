"""Packed int8/int4/fp8 experts to plain matrices in one pass on the GPU (a Triton kernel).

The native operator packs each matrix in 16-row blocks: int8 as [np/16][kp/4][16][4] bytes
(value + 128), int4 as [np/16][kp/8][16][4] bytes (byte i of a quad holds k = 8q + i in its low
nibble and 8q + 4 + i in its high one; value + 8), fp8 as [np/16][kp/2][16][2] e4m3 bytes (read
through binary16 bits, as the CPU kernels do), with one float32 scale per row and group of
`group` columns, laid out [np/16][kp/group][16]. Each program of the kernel writes a 16 x BLOCK_K
tile of one expert's [n, k] output: it reads the tile's bytes (one contiguous run of the packed
block) and scales once and writes the tile once, in the output's dtype and strides.

`moe_gpu.unpack_matrix` calls `dequantize` where the data is on a CUDA device and Triton is
importable; the torch fallback there (several passes through int16 and float32 temporaries as
large as the output) is the reference the GPU tests compare against.
"""

from __future__ import annotations

import functools

import torch

BLOCK_K = 256  # columns per program (a multiple of 8: whole int4 octets)
KINDS = {"int8": 0, "int4": 1, "fp8": 2}


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(data, data_row, scales, scales_row, out, out_e, out_n, out_k, n, k, kp: tl.constexpr,
                group: tl.constexpr, kind: tl.constexpr, block_k: tl.constexpr):
        e = tl.program_id(0)
        blk = tl.program_id(1)  # 16-row block
        c0 = tl.program_id(2) * block_k
        r = tl.arange(0, 16)[:, None]
        c = c0 + tl.arange(0, block_k)[None, :]
        packed = (c < kp) & (r < 16)  # [16, block_k]: the tile's columns inside the packed matrix
        if kind == 2:  # fp8: e4m3 bits into a binary16's (value * 2^-8), the sign to bit 15
            byte = ((blk * (kp // 2) + c // 2) * 16 + r) * 2 + (c % 2)
            raw = tl.load(data + e.to(tl.int64) * data_row + byte, mask=packed, other=0).to(tl.int16)
            half = (((raw & 0x7F) << 7) | ((raw & 0x80) << 8)).to(tl.float16, bitcast=True)
            q = half.to(tl.float32) * 256.0
        elif kind == 1:  # int4
            j = c % 8
            byte = ((blk * (kp // 8) + c // 8) * 16 + r) * 4 + (j % 4)
            raw = tl.load(data + e.to(tl.int64) * data_row + byte, mask=packed, other=0).to(tl.int32)
            q = tl.where(j < 4, raw & 15, raw >> 4) - 8
        else:
            byte = ((blk * (kp // 4) + c // 4) * 16 + r) * 4 + (c % 4)
            q = tl.load(data + e.to(tl.int64) * data_row + byte, mask=packed, other=0).to(tl.int32) - 128
        s = tl.load(scales + e.to(tl.int64) * scales_row + (blk * (kp // group) + c // group) * 16 + r,
                    mask=packed, other=0.0)
        rows = blk * 16 + r
        keep = (rows < n) & (c < k)
        dst = out + e.to(tl.int64) * out_e + rows.to(tl.int64) * out_n + c * out_k
        tl.store(dst, (q.to(tl.float32) * s).to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)

    return triton, dequant


def available(device: torch.device) -> bool:
    """Whether Triton kernels (this module's, and fp8_gpu's) run for tensors on `device`: CUDA, Triton
    importable."""
    if device.type != "cuda":
        return False
    try:
        _kernel()
    except ImportError:
        return False
    return True


def dequantize(fmt: str, data: torch.Tensor, scales: torch.Tensor, np_: int, kp: int, group: int,
               out: torch.Tensor) -> None:
    """`data` [e, bytes] (uint8, rows may be strided) and `scales` [e, bytes] packed as `fmt`
    (int8, int4 or fp8) into `out` [e, n, k] (n <= np_, k <= kp; any strides, any float dtype)."""
    triton, kernel = _kernel()
    e, n, k = out.shape
    s = scales.view(torch.float32)
    grid = (e, np_ // 16, triton.cdiv(kp, BLOCK_K))
    kernel[grid](data, data.stride(0), s, s.stride(0), out, out.stride(0), out.stride(1), out.stride(2), n, k,
                 kp=kp, group=group, kind=KINDS[fmt], block_k=BLOCK_K)
