"""RMSNorm, rotary embedding and the greedy router as one Triton kernel each on the GPU.

- `rms_norm`: `layers.rms_norm_torch`'s arithmetic and roundings (the row in float32, rounded to
  the input's dtype before the weight, then to the result type of (weight, input)); only the
  reduction order differs: results agree to within one rounding of the output dtype.
- `rotate`: `rope.apply`'s rotation in float32, rounded once (the torch form rounds each product
  too: they agree to within those roundings); partial rotary, and both pair layouts ('half', and
  'interleaved' returned de-interleaved, as `rope.apply` does).
- `route`: a greedy router without a choice bias (softmax or sigmoid top-k, ties to the lowest
  index, renormalisation and scale); grouped and biased routers (DeepSeek) keep the torch form.
`layers` calls these for CUDA tensors where Triton is importable (`dequant_gpu.available`); the
torch forms stay the reference the GPU tests compare against. Why: docs/design-notes.md.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rmsnorm(x, x_row, w, out, n, eps, block: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, block)
        inside = c < n
        xv = tl.load(x + r * x_row + c, mask=inside, other=0.0).to(tl.float32)
        ms = tl.sum(xv * xv, axis=0) / n
        y = (xv * tl.rsqrt(ms + eps)).to(x.dtype.element_ty, fp_downcast_rounding="rtne")
        wv = tl.load(w + c, mask=inside, other=0.0).to(tl.float32)
        yo = (wv * y.to(tl.float32)).to(out.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out + r * n + c, yo, mask=inside)

    @triton.jit
    def rope(x, x_tok, x_head, cos, sin, out, seq, heads, dim, half: tl.constexpr, interleaved: tl.constexpr,
             block_h: tl.constexpr, block_i: tl.constexpr, block_rest: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * block_h + tl.arange(0, block_h)[:, None]
        i = tl.arange(0, block_i)[None, :]
        pair = (h < heads) & (i < half)
        src = x + t * x_tok + h * x_head
        dst = out + (t * heads + h) * dim
        if interleaved:
            x1 = tl.load(src + 2 * i, mask=pair, other=0.0)
            x2 = tl.load(src + 2 * i + 1, mask=pair, other=0.0)
        else:
            x1 = tl.load(src + i, mask=pair, other=0.0)
            x2 = tl.load(src + half + i, mask=pair, other=0.0)
        row = (t % seq) * half
        c = tl.load(cos + row + i, mask=i < half, other=0.0).to(tl.float32)
        s = tl.load(sin + row + i, mask=i < half, other=0.0).to(tl.float32)
        ty = out.dtype.element_ty
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (a * c - b * s).to(ty, fp_downcast_rounding="rtne")
        o2 = (b * c + a * s).to(ty, fp_downcast_rounding="rtne")
        tl.store(dst + i, o1, mask=pair)
        tl.store(dst + half + i, o2, mask=pair)
        if block_rest > 0:  # partial rotary: the dims past 2 * half pass through
            j = 2 * half + tl.arange(0, block_rest)[None, :]
            keep = (h < heads) & (j < dim)
            tl.store(dst + j, tl.load(src + j, mask=keep, other=0.0), mask=keep)

    @triton.jit
    def route(logits, row, ids, wts, experts, k: tl.constexpr, sigmoid: tl.constexpr, renormalize: tl.constexpr,
              scale, block_e: tl.constexpr, block_k: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, block_e)
        inside = e < experts
        x = tl.load(logits + t * row + e, mask=inside, other=float("-inf"))
        if sigmoid:
            s = 1.0 / (1.0 + tl.exp(-x))
        else:
            p = tl.exp(x - tl.max(x, axis=0))
            s = p / tl.sum(tl.where(inside, p, 0.0), axis=0)
        choice = tl.where(inside, s, float("-inf"))
        j = tl.arange(0, block_k)
        got_ids = tl.zeros([block_k], dtype=tl.int64)
        got_wts = tl.zeros([block_k], dtype=tl.float32)
        for i in tl.static_range(k):  # the best left, lowest index among equals, then out of the running
            best = tl.max(choice, axis=0)
            at = tl.min(tl.where(choice == best, e, block_e), axis=0)
            got_ids = tl.where(j == i, at.to(tl.int64), got_ids)
            got_wts = tl.where(j == i, best, got_wts)
            choice = tl.where(e == at, float("-inf"), choice)
        if renormalize:
            got_wts = got_wts / tl.sum(tl.where(j < k, got_wts, 0.0), axis=0)
        tl.store(ids + t * k + j, got_ids, mask=j < k)
        tl.store(wts + t * k + j, got_wts * scale, mask=j < k)

    return triton, rmsnorm, rope, route


def route_fusable(a) -> bool:
    """Whether `route` computes this router (GateAttrs): top-k of all scores, no choice bias."""
    return a.select == "greedy" and not a.correction_bias and a.experts <= 4096 and a.top_k <= 64


def route(a, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ref.route for a greedy router without bias: the logits as one GEMM with a float32
    output, then scores, top-k, renormalisation and scale in one kernel. Picks come out by score,
    descending, which is by weight, as torch_ref.route sorts them."""
    triton, _, _, kernel = _kernels()
    if x.dtype == weight.dtype:
        logits = torch.mm(x, weight.t(), out_dtype=torch.float32)
    else:
        logits = torch.mm(x.float(), weight.float().t())
    t = x.shape[0]
    ids = torch.empty(t, a.top_k, dtype=torch.int64, device=x.device)
    wts = torch.empty(t, a.top_k, dtype=torch.float32, device=x.device)
    if t:
        kernel[(t,)](logits, logits.stride(0), ids, wts, a.experts, k=a.top_k, sigmoid=a.scoring == "sigmoid",
                     renormalize=a.renormalize, scale=float(a.scale), block_e=triton.next_power_of_2(a.experts),
                     block_k=triton.next_power_of_2(a.top_k),
                     # up to 256 scores fit one warp's registers: its reductions are shuffles, no barriers
                     num_warps=1 if a.experts <= 256 else 4)
    return ids, wts


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., n] with weight w [n] (the torch form's result type)."""
    triton, kernel, _, _ = _kernels()
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view where the leading dims collapse, else one copy
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype), device=x.device)
    if rows.shape[0] == 0:
        return out
    block = triton.next_power_of_2(n)
    kernel[(rows.shape[0],)](rows, rows.stride(0), w.contiguous(), out, n, float(eps), block=block,
                             num_warps=4 if block <= 2048 else 8)
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str) -> torch.Tensor:
    """`rope.apply` in one kernel: x [..., S, heads, dim] with cos/sin [S, r/2] (r <= dim)."""
    triton, _, kernel, _ = _kernels()
    *lead, seq, heads, dim = x.shape
    half = cos.shape[-1]
    rows = x.reshape(-1, heads, dim)  # tokens (batch and sequence) as one dim, a view where possible
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    block_h = min(16, triton.next_power_of_2(heads))
    rest = dim - 2 * half
    kernel[(rows.shape[0], triton.cdiv(heads, block_h))](
        rows, rows.stride(0), rows.stride(1), cos.contiguous(), sin.contiguous(), out, seq, heads, dim, half=half,
        interleaved=pairs != "half", block_h=block_h, block_i=triton.next_power_of_2(half),
        block_rest=triton.next_power_of_2(rest) if rest > 0 else 0)
    return out
