"""The elementwise stages of token selection as two Triton kernels (one pass over the logits each).

`backends.sampling.select_ids` runs these where the logits are on a CUDA device and Triton is
importable; its torch ops (a dozen passes over [rows, vocab] for the penalties alone, each a
kernel of its own in the captured graph) are the fallback and the reference the GPU tests
compare against:

- `penalize_(x, counts, in_prompt, repetition, presence, frequency)`: in place, each row's
  repetition penalty on tokens its prompt holds or it generated (x / r where x > 0, else x * r),
  then x - frequency * count - presence * (count > 0);
- `weights(x, best, temperature)`: exp((x - x[best]) / t) per row (t = 1 for greedy rows): the
  unnormalised probabilities at the row's temperature, the most likely token's 1.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 2048  # tokens per program


@functools.cache
def available(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device` (a CUDA device with Triton importable)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: the torch fallback runs
        return False
    return True


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

    return triton, penalize, weights


def penalize_(x: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor,
              presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] float32 (contiguous) penalised in place; returns x."""
    triton, kernel, _ = _kernels()
    rows, vocab = x.shape
    kernel[(rows, triton.cdiv(vocab, BLOCK))](x, counts, in_prompt.view(torch.uint8), repetition, presence, frequency,
                                             vocab, block=BLOCK)
    return x


def weights(x: torch.Tensor, best: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """exp((x - x[row, best[row]]) / t[row]) for x [rows, vocab] float32 (contiguous)."""
    triton, _, kernel = _kernels()
    rows, vocab = x.shape
    out = torch.empty_like(x)
    kernel[(rows, triton.cdiv(vocab, BLOCK))](x, best, temperature, out, vocab, block=BLOCK)
    return out
