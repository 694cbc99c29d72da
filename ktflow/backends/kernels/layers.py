"""The math every backend shares: norms, linear layers, SwiGLU, the attention projections, and
attention itself, written once so that the reference backend and the fast ones differ only where
they must (the routed experts).

Attention never materialises a [heads, T, T] score matrix: `scaled_dot_product_attention` with
`is_causal` over the step's own keys when a prompt starts at position 0 (flash kernels; grouped
heads through `enable_gqa`); a step that continues a sequence attends through a lower-right causal
mask in the flash kernel where torch runs it (CUDA, 16-bit), else (and with a sliding window)
through an explicit [rows, keys] mask in blocks of MASK_ROWS query rows, keys expanded to every
head (memory-efficient kernels); one decode token attends to every cached key without a mask. MLA runs in the
non-absorbed form: per-head keys and values expanded from the compressed cache, the values padded
to the key width so the flash kernels take them. memory.SCRATCH mirrors these temporaries.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from . import rope as rope_mod
from ...costmodel.memory import flash_continues
from ...util.notices import warn
from ...ir.ops import AttentionAttrs
from . import fused_gpu
from .dequant_gpu import available as triton_on
from .fp8_gpu import Fp8Weight
from .fp8_gpu import linear as fp8_linear

Weights = dict  # role -> tensor (per-expert roles: expert -> tensor)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and triton_on(x.device):
        return fused_gpu.rms_norm(x, w, eps)  # the same arithmetic in one kernel
    return rms_norm_torch(x, w, eps)


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference form (fused_gpu's kernel is checked against it)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str) -> torch.Tensor:
    """rope.apply; on a GPU with Triton one kernel (fused_gpu.rotate: it rounds once where rope.apply
    rounds each product, so the two agree within the activation dtype's rounding)."""
    if x.is_cuda and cos.dtype == x.dtype and triton_on(x.device):
        return fused_gpu.rotate(x, cos, sin, pairs)
    return rope_mod.apply(x, cos, sin, pairs)


def matmul(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) for a weight in the activation dtype or held in FP8 (fp8_gpu.Fp8Weight)."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias)
    return F.linear(x, w, bias)


def linear(x: torch.Tensor, w: Weights, role: str) -> torch.Tensor:
    return matmul(x, w[role], w.get(role + "_bias"))


def swiglu(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    return matmul(F.silu(matmul(x, gate)) * matmul(x, up), down)


def gqa_project(a: AttentionAttrs, w, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [B,S,H] -> q [B,S,heads,d], k and v [B,S,kv_heads,d]: projections, q/k norms, rope."""
    b, s = x.shape[:2]
    q = linear(x, w, "q").view(b, s, a.heads, a.head_dim)
    k = linear(x, w, "k").view(b, s, a.kv_heads, a.head_dim)
    v = linear(x, w, "v").view(b, s, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = rms_norm(q, w["q_norm"], a.norm_eps), rms_norm(k, w["k_norm"], a.norm_eps)
    return rotate(q, cos, sin, a.rope.pairs), rotate(k, cos, sin, a.rope.pairs), v


def mla_project(a: AttentionAttrs, w, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [B,S,H] -> q_nope [B,S,heads,nope], roped q_rope [B,S,heads,rope], the normalised latent
    [B,S,kv_lora_rank] and the roped key [B,S,1,rope] (what the cache holds)."""
    b, s = x.shape[:2]
    nope, rdim, kvl = a.qk_nope_dim, a.qk_rope_dim, a.kv_lora_rank
    if a.q_lora_rank:
        q = linear(rms_norm(linear(x, w, "q_a"), w["q_a_norm"], a.norm_eps), w, "q_b")
    else:
        q = linear(x, w, "q")
    q = q.view(b, s, a.heads, nope + rdim)
    kv = linear(x, w, "kv_a")
    latent = rms_norm(kv[..., :kvl], w["kv_a_norm"], a.norm_eps)
    k_rope = kv[..., kvl:].view(b, s, 1, rdim)
    return (q[..., :nope], rotate(q[..., nope:], cos, sin, a.rope.pairs), latent,
            rotate(k_rope, cos, sin, a.rope.pairs))


#: query rows per block of the masked attention path (the mask is [rows, keys] booleans)
MASK_ROWS = 1024


# ------------------------------------------------------------------------------- attention


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttentionAttrs, position: int) -> torch.Tensor:
    """q [B,h,S,d] at positions position.., k/v [B,hk,L,d] at 0..L-1 -> [B,h,S,d], causal (and
    windowed)."""
    s, L = q.shape[2], k.shape[2]
    grouped = q.shape[1] != k.shape[1]
    if s == 1 and not a.window:  # one query sees every key: no mask (a decode step run eagerly)
        return _unmasked(q, k, v, a, causal=False)
    if position == 0 and s == L and not a.window:
        return _unmasked(q, k, v, a, causal=True)
    if L == position + s and not a.window and _flash_continues(q, k, v, grouped):
        # a chunk continuing its sequence: query i sees keys 0..position+i, the causal mask aligned
        # to the last key; the flash kernel takes it (and grouped heads) without a mask or copies
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s, L), scale=a.softmax_scale,
                                              enable_gqa=grouped)
    if grouped:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kpos = torch.arange(L, device=q.device)[None, :]
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    for lo in range(0, s, MASK_ROWS):
        hi = min(s, lo + MASK_ROWS)
        qpos = torch.arange(position + lo, position + hi, device=q.device)[:, None]
        allowed = kpos <= qpos
        if a.window:
            allowed &= (qpos - kpos) < a.window
        last = position + hi  # keys past the block's last query are never visible
        out[:, :, lo:hi] = F.scaled_dot_product_attention(q[:, :, lo:hi], k[:, :, :last], v[:, :, :last],
                                                          attn_mask=allowed[:, :last], scale=a.softmax_scale)
    return out


def _flash_continues(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grouped: bool) -> bool:
    """Whether torch's flash kernel runs a continued chunk's attention here (NVIDIA CUDA, 16-bit,
    a head width it takes, an Ampere or later GPU). ROCm's flash kernel aligns a causal mask to
    the first key, not the last, so ROCm takes the masked path. Where the memory model counted on
    flash (memory.flash_continues) and it cannot run, a warning says the plan's VRAM is low."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or torch.version.hip is not None:
        return False
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, grouped)
        ok = bool(torch.backends.cuda.can_use_flash_attention(params))
    except (TypeError, AttributeError, RuntimeError):
        ok = False
    if not ok and grouped and flash_continues(q.shape[-1], q.element_size()):
        warn("torch's flash attention cannot run a continued prompt chunk here (an older GPU, or flash "
             "turned off): its keys are expanded to every head, which the VRAM plan did not count",
             key="flash_continues")
    return ok


#: on CUDA, attention over a step of at most this many queries runs without cuDNN's kernel: cuDNN
#: builds a plan for each new shape (66-80 ms on the H200, 0.8 s the first), which each new prompt
#: length pays once a process; the flash kernel builds none and is within 0.1 ms of cuDNN's up
#: to 2048 queries. Longer steps take cuDNN's kernel (half the flash kernel's time from 8192).
UNPLANNED_ROWS = 4096
_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttentionAttrs, causal: bool) -> torch.Tensor:
    """Flash attention over every key (causal: query i sees keys 0..i); grouped heads through
    enable_gqa, or expanded on a torch without it (before 2.5). A short step on CUDA: without
    cuDNN's kernel (UNPLANNED_ROWS)."""
    if q.is_cuda and q.shape[2] <= UNPLANNED_ROWS:
        with sdpa_kernel(_WITHOUT_CUDNN):
            return _any_sdpa(q, k, v, a, causal)
    return _any_sdpa(q, k, v, a, causal)


def _any_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttentionAttrs, causal: bool) -> torch.Tensor:
    if q.shape[1] != k.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=a.softmax_scale, enable_gqa=True)
        except TypeError:  # no enable_gqa argument (an out-of-memory error, say, is not retried)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=a.softmax_scale)


def gqa(be, a: AttentionAttrs, w, x: torch.Tensor, ctx, dev) -> torch.Tensor:
    b, s, p = ctx.batch, ctx.seq, ctx.position
    q, k, v = gqa_project(a, w, x.view(b, s, -1), *be.rope_tables(a, ctx, dev))
    kc, vc = be.cache(ctx, a, dev)
    kc[:, :, p:p + s] = k.transpose(1, 2)
    vc[:, :, p:p + s] = v.transpose(1, 2)
    if p == 0 and not a.window:
        keys, vals = k.transpose(1, 2), v.transpose(1, 2)
    else:
        keys, vals = kc[:, :, :p + s], vc[:, :, :p + s]
    out = _sdpa(q.transpose(1, 2), keys, vals, a, p)
    return linear(out.transpose(1, 2).reshape(b, s, -1), w, "o").view(b * s, -1)


def mla(be, a: AttentionAttrs, w, x: torch.Tensor, ctx, dev) -> torch.Tensor:
    b, s, p = ctx.batch, ctx.seq, ctx.position
    nope, rdim, vd, h = a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim, a.heads
    q_nope, q_rope, latent, k_rope = mla_project(a, w, x.view(b, s, -1), *be.rope_tables(a, ctx, dev))
    lc, rc, _ = be.cache(ctx, a, dev)
    lc[:, p:p + s] = latent
    rc[:, p:p + s] = k_rope[:, :, 0]
    L = p + s
    kvb = F.linear(lc[:, :L], w["kv_b"]).view(b, L, h, nope + vd)
    keys = torch.cat([kvb[..., :nope], rc[:, :L, None].expand(b, L, h, rdim)], dim=-1).transpose(1, 2)
    queries = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
    width = max(nope + rdim, vd)  # the flash kernels take one head width for q, k and v
    pad = lambda t: t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    out = _sdpa(pad(queries), pad(keys), pad(kvb[..., nope:].transpose(1, 2)), a, p)[..., :vd]
    return linear(out.transpose(1, 2).reshape(b, s, h * vd), w, "o").view(b * s, -1)


def attention(be, node, w, ins, ctx, dev):
    rule = mla if node.attrs.kind == "mla" else gqa
    if ctx.positions is None and ctx.segments is None:
        return rule(be, node.attrs, w, ins[0], ctx, dev)
    # several sequences in one step (a ragged decode step: a token per row at its own position; a
    # packed prefill: prompt chunks one after another): one sequence at a time, each over its own
    # row of the caches
    segments = ctx.segments or tuple((i, int(p), 1) for i, p in enumerate(ctx.positions))
    x = ins[0].view(-1, ins[0].shape[-1])
    outs, lo = [], 0
    for row, position, n in segments:
        outs.append(rule(be, node.attrs, w, x[lo:lo + n], segment_context(ctx, row, position, lo, n), dev))
        lo += n
    return torch.cat(outs)


def segment_context(ctx, row: int, position: int, lo: int, n: int):
    """Tokens lo..lo+n of a step holding several sequences, as a step of their own: batch 1, at
    `position`, over row `row` of the caches."""
    return replace(ctx, batch=1, seq=n, position=position, state=ctx.state.row(row, position),
                   token_ids=ctx.token_ids[lo:lo + n], positions=None, segments=None, position_t=None, shared={})
