"""The elementwise stages of token selection as two Triton kernels (one pass over the logits each).

`backends.sampling.select_ids` runs these where the logits are on a CUDA device and Triton is
importable (`dequant_gpu.available`); its torch ops (a dozen passes over [rows, vocab] for the penalties alone, each a
kernel of its own in the captured graph) are the fallback and the reference the GPU tests
compare against:

- `penalize_(x, counts, in_prompt, repetition, presence, frequency)`: in place, each row's
  repetition penalty on tokens its prompt holds or it generated (x / r where x > 0, else x * r),
  then x - frequency * count - presence * (count > 0);
- `weights(x, best, temperature)`: exp((x - x[best]) / t) per row (t = 1 for greedy rows): the
  unnormalised probabilities at the row's temperature, the most likely token's 1;
- `uniform(seed_lo, seed_hi, counter)`: each row's u of the counter-based stream, the same bits
  as `sampling.uniform`'s torch ops (forty tiny kernels there, one here).
"""

from __future__ import annotations

import functools

import torch

BLOCK = 2048  # tokens per program


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def penalize(x, counts, seen, rep, pres, freq, vocab, block: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * block + tl.arange(0, block)
        inside = col < vocab
        at = row.to(tl.int64) * vocab + col
        v = tl.load(x + at, mask=inside, other=0.0)
        n = tl.load(counts + at, mask=inside, other=0).to(tl.float32)
        prompt = tl.load(seen + at, mask=inside, other=0) != 0
        r = tl.load(rep + row)
        v = tl.where(prompt | (n > 0), tl.where(v > 0, v / r, v * r), v)
        v = v - tl.load(freq + row) * n - tl.load(pres + row) * (n > 0).to(tl.float32)
        tl.store(x + at, v, mask=inside)

    @triton.jit
    def weights(x, best, temp, out, vocab, block: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * block + tl.arange(0, block)
        inside = col < vocab
        base = row.to(tl.int64) * vocab
        top = tl.load(x + base + tl.load(best + row))
        t = tl.load(temp + row)
        t = tl.where(t > 0, t, 1.0)
        v = tl.load(x + base + col, mask=inside, other=float("-inf"))
        tl.store(out + base + col, tl.exp((v - top) / t), mask=inside)

    @triton.jit
    def mix(x):  # x: uint64 holding 32 bits; each product (< 2**64) cut back to 32 bits
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def uniform(seed_lo, seed_hi, counter, out, rows, block: tl.constexpr):
        i = tl.arange(0, block)
        inside = i < rows
        lo = tl.load(seed_lo + i, mask=inside, other=0).to(tl.uint64)
        hi = tl.load(seed_hi + i, mask=inside, other=0).to(tl.uint64)
        n = tl.load(counter + i, mask=inside, other=0).to(tl.uint64) & 0xFFFFFFFF
        a = mix(n ^ mix(hi ^ 0x9E3779B9))
        b = mix(a ^ lo)
        c = mix(b ^ 0x85EBCA6B)
        u = ((b >> 5).to(tl.float64) * 67108864.0 + (c >> 6).to(tl.float64)) / 9007199254740992.0
        tl.store(out + i, u, mask=inside)

    return triton, penalize, weights, uniform


def penalize_(x: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor,
              presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] float32 (contiguous) penalised in place; returns x."""
    triton, kernel, _, _ = _kernels()
    rows, vocab = x.shape
    kernel[(rows, triton.cdiv(vocab, BLOCK))](x, counts, in_prompt.view(torch.uint8), repetition, presence, frequency,
                                             vocab, block=BLOCK)
    return x


def weights(x: torch.Tensor, best: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """exp((x - x[row, best[row]]) / t[row]) for x [rows, vocab] float32 (contiguous)."""
    triton, _, kernel, _ = _kernels()
    rows, vocab = x.shape
    out = torch.empty_like(x)
    kernel[(rows, triton.cdiv(vocab, BLOCK))](x, best, temperature, out, vocab, block=BLOCK)
    return out


def uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """`sampling.uniform` for int64 [rows] tensors on a CUDA device, in one kernel."""
    triton, _, _, kernel = _kernels()
    rows = seed_lo.shape[0]
    out = torch.empty(rows, dtype=torch.float64, device=seed_lo.device)
    kernel[(1,)](seed_lo, seed_hi, counter, out, rows, block=max(triton.next_power_of_2(rows), 16))
    return out
