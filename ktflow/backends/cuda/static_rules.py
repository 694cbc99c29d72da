"""Op rules for a step whose position is a tensor: what a CUDA graph can capture and replay.

The rules read the position from `ctx.position_t` (a one-element int64 tensor on the rule's
device, rewritten before each replay; a ragged step's has a row each, each row at its own
position) and keep every shape static, so one captured graph serves every position: rope rows
from a table of every position the KV cache holds, cache rows written at the position, attention
over the whole static cache masked to the positions reached (and the sliding window), MLA absorbed
(per-head keys and values never expanded), GPU-resident routed experts gathered per token from the
node's stacked weights (picks of experts held elsewhere get weight 0). Cache layouts are
torch_ref's. They run on any device (tests compare them with torch_ref on the CPU) and are used for
decode steps, the ones captured as graphs. How each rule stays static: docs/design-notes.md.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..kernels import rope as rope_mod
from ...ir.graph import Graph
from ...ir.ops import AttentionAttrs, Op
from ...ir.types import Device
from ..kernels import attention_gpu
from ..base import StepContext, node_key
from ..kernels.fp8_gpu import Fp8Weight, dequantize_experts, picked_linear, picks_fused
from ..kernels.layers import gqa_project, linear, mla_project, rms_norm


class RopeTables:
    """cos/sin of every position < length, per rope, device and length (built once each, kept:
    captured graphs read them)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.tables: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, r, pos: torch.Tensor, s: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (r, pos.device, length)
        if key not in self.tables:
            freqs = rope_mod.inv_freq(r).to(pos.device)
            self.tables[key] = rope_mod.cos_sin(r, freqs, torch.arange(length, device=pos.device), self.dtype)
        cos, sin = self.tables[key]
        rows = pos + torch.arange(s, device=pos.device)
        return cos.index_select(0, rows), sin.index_select(0, rows)


def _visible(a: AttentionAttrs, pos: torch.Tensor, s: int, length: int) -> torch.Tensor:
    """[s, length] bool: may query i (at pos + i) see cache position j; for a ragged step (a
    position per row, s = 1) [rows, 1, 1, length]: may row r's query see its position j."""
    qpos = (pos + torch.arange(s, device=pos.device))[:, None]
    kpos = torch.arange(length, device=pos.device)[None, :]
    ok = kpos <= qpos
    if a.window:
        ok &= (qpos - kpos) < a.window
    return ok[:, None, None, :] if pos.numel() > 1 else ok


def ragged(ctx: StepContext) -> bool:
    """Is this a ragged step: one decode token per row, each row at its own position
    (`ctx.position_t` holds one per row)?"""
    return ctx.position_t.numel() > 1


def _tokens_as_sequence(ctx: StepContext) -> tuple[int, int]:
    """The [B, S] the projections see: a ragged step's rows as one sequence of `batch` tokens (so
    each takes its own rope row), otherwise the step's own."""
    return (1, ctx.batch) if ragged(ctx) else (ctx.batch, ctx.seq)


def _write(cache: torch.Tensor, dim: int, new: torch.Tensor, ctx: StepContext) -> None:
    """The step's new entries `new` (the cache's shape, `seq` long along `dim`) into `cache` at
    the step's positions: the same rows for every sequence with index_copy_, or on a ragged step
    each row at its own position."""
    if not ragged(ctx):
        cache.index_copy_(dim, _new_rows(ctx), new)
        return
    rows = ctx.once(("batch rows", cache.device), lambda: torch.arange(ctx.batch, device=cache.device))
    cache[(rows,) + (slice(None),) * (dim - 1) + (ctx.position_t,)] = new.select(dim, 0)


#: the tables of each dtype (kept for the process: captured graphs read them)
_TABLES: dict[torch.dtype, RopeTables] = {}


def _rope_rows(be, a: AttentionAttrs, ctx: StepContext):
    """cos/sin at the step's positions (once per step and rope)."""
    pos, s, length = ctx.position_t, ctx.seq, ctx.state.max_seq_len
    tables = _TABLES.setdefault(be.dtype, RopeTables(be.dtype))
    return ctx.once(("rope", a.rope, pos.device, length), lambda: tables.at(a.rope, pos, s, length))


def _new_rows(ctx: StepContext) -> torch.Tensor:
    """The cache rows the step's tokens are written to (once per step)."""
    pos = ctx.position_t
    return ctx.once(("rows", pos.device), lambda: pos + torch.arange(ctx.seq, device=pos.device))


def _mask(a: AttentionAttrs, ctx: StepContext, length: int) -> torch.Tensor:
    """_visible once per step, window and cache length."""
    pos = ctx.position_t
    return ctx.once(("visible", a.window, length, pos.device), lambda: _visible(a, pos, ctx.seq, length))


def gqa(be, a: AttentionAttrs, w, x: torch.Tensor, ctx: StepContext, dev) -> torch.Tensor:
    b, s = ctx.batch, ctx.seq
    if attention_gpu.fusable(a, w, x):
        return gqa_fused(be, a, w, x, ctx, dev)
    q, k, v = gqa_project(a, w, x.view(*_tokens_as_sequence(ctx), -1), *_rope_rows(be, a, ctx))
    q, k, v = (t.view(b, s, *t.shape[2:]) for t in (q, k, v))
    kc, vc = be.cache(ctx, a, dev)
    _write(kc, 2, k.transpose(1, 2), ctx)
    _write(vc, 2, v.transpose(1, 2), ctx)
    mask = _mask(a, ctx, kc.shape[2])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, attn_mask=mask, scale=a.softmax_scale,
                                         enable_gqa=a.heads != a.kv_heads)
    return linear(out.transpose(1, 2).reshape(b, s, -1), w, "o").view(b * s, -1)


def _kernel_tokens(ctx: StepContext) -> tuple[int, bool]:
    """(tokens a row, ragged) as attention_gpu's kernels read a step: a ragged step's rows one token
    each at their own position."""
    return (1, True) if ragged(ctx) else (ctx.seq, False)


def gqa_fused(be, a: AttentionAttrs, w, x: torch.Tensor, ctx: StepContext, dev) -> torch.Tensor:
    """gqa in attention_gpu's kernels: one GEMM for q, k and v, one kernel for the norms, the
    rotation and the cache writes, one (or a split and a merge) for attention up to each token's
    position."""
    kc, vc = be.cache(ctx, a, dev)
    qkv = linear(x.view(-1, x.shape[-1]), w, "qkv")
    cos, sin = _rope_rows(be, a, ctx)
    seq, ragged_step = _kernel_tokens(ctx)
    q = attention_gpu.project(a, qkv, w, cos, sin, ctx.position_t, kc, vc, seq, ragged_step)
    return linear(attention_gpu.attend(a, q, kc, vc, ctx.position_t, seq, ragged_step), w, "o")


def absorbed_kv_b(a: AttentionAttrs, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [heads * (nope + v), kv_lora_rank] as W_uk [heads, nope, rank] and W_uv [heads, v, rank]."""
    per = kv_b.view(a.heads, a.qk_nope_dim + a.v_head_dim, a.kv_lora_rank)
    return per[:, :a.qk_nope_dim], per[:, a.qk_nope_dim:]


def mla(be, a: AttentionAttrs, w, x: torch.Tensor, ctx: StepContext, dev) -> torch.Tensor:
    b, s = ctx.batch, ctx.seq
    if attention_gpu.fusable(a, w, x):
        return mla_fused(be, a, w, x, ctx, dev)
    projected = mla_project(a, w, x.view(*_tokens_as_sequence(ctx), -1), *_rope_rows(be, a, ctx))
    q_nope, q_rope, latent, k_rope = (t.view(b, s, *t.shape[2:]) for t in projected)
    lc, rc, both = be.cache(ctx, a, dev)
    _write(lc, 1, latent, ctx)
    _write(rc, 1, k_rope[:, :, 0], ctx)
    w_uk, w_uv = absorbed_kv_b(a, w["kv_b"])
    # queries in the latent space, beside their rope part: one key head [latent | rope] shared by
    # every query head, the latent as its value. Two GEMMs with the heads folded into the rows (an
    # sdpa over one shared head falls back to its math kernel, which expands the cache per head:
    # 17x slower at a 32k cache); scores and softmax in float32, not rounded to bf16 first
    q_lat = torch.einsum("bshn,hnc->bhsc", q_nope, w_uk)
    q = torch.cat([q_lat, q_rope.transpose(1, 2)], dim=-1).reshape(b, a.heads * s, -1)
    scores = _scores_f32(q, both).view(b, a.heads, s, -1) * a.softmax_scale
    scores.masked_fill_(~_mask(a, ctx, lc.shape[1]), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(lc.dtype).view(b, a.heads * s, -1)
    o_lat = torch.bmm(probs, lc).view(b, a.heads, s, -1)
    out = torch.einsum("bhsc,hvc->bshv", o_lat, w_uv).reshape(b, s, -1)
    return linear(out, w, "o").view(b * s, -1)


def mla_fused(be, a: AttentionAttrs, w, x: torch.Tensor, ctx: StepContext, dev) -> torch.Tensor:
    """mla in attention_gpu's kernels: one GEMM for the query (or its LoRA's first half) and kv_a
    together, one kernel for the latent's norm, the rotations and the cache writes, the queries
    folded into the latent space (q_nope x W_uk), one kernel (or a split and a merge) for
    attention over the latent cache up to each token's position, W_uv and o."""
    _, _, both = be.cache(ctx, a, dev)
    rows = x.view(-1, x.shape[-1])
    t, kv_width = rows.shape[0], a.kv_lora_rank + a.qk_rope_dim
    first = linear(rows, w, "q_kv_a")
    q = first[:, :-kv_width]
    if a.q_lora_rank:
        q = linear(rms_norm(q, w["q_a_norm"], a.norm_eps), w, "q_b")
    cos, sin = _rope_rows(be, a, ctx)
    seq, ragged_step = _kernel_tokens(ctx)
    q_rope = attention_gpu.mla_project(a, q, first[:, -kv_width:], w["kv_a_norm"], cos, sin, ctx.position_t, both,
                                       seq, ragged_step)
    w_uk, w_uv = absorbed_kv_b(a, w["kv_b"])
    q_nope = q.view(t, a.heads, a.qk_nope_dim + a.qk_rope_dim)[..., :a.qk_nope_dim]
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    o_lat = attention_gpu.attend_latent(a, q_lat, q_rope, both, ctx.position_t, seq, ragged_step)
    return linear(torch.einsum("thc,hvc->thv", o_lat, w_uv).reshape(t, -1), w, "o")


def _scores_f32(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, M, D] x k [B, L, D]^T in float32: on the GPU one GEMM that keeps its float32
    accumulator as the output; elsewhere (no such kernel) the operands in float32."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    return torch.bmm(q.float(), k.float().transpose(1, 2))


def attention(be, node, w, ins, ctx, dev):
    return (mla if node.attrs.kind == "mla" else gqa)(be, node.attrs, w, ins[0], ctx, dev)


def _picked(stack, stack_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The picks' matrices of one stacked projection: its rows `stack_rows`, gathered; from a stack held
    in FP8 (fp8_gpu.Fp8Weight) their bytes and scales gathered and dequantized to `dtype` (a
    temporary each projection in turn: memory.fp8_experts_dequant_bytes)."""
    if isinstance(stack, Fp8Weight):
        return dequantize_experts(stack, dtype, stack_rows)
    return stack[stack_rows]


def routed_experts(be, node, w, ins, ctx, dev):
    """Each token's picks in the node's rank range, gathered from the stacked weights (reads
    only the picked experts; no host-side look at the ids). Experts held in FP8: on CUDA with
    Triton one fused kernel per projection (fp8_gpu.picked_linear: each pick's bytes read once);
    elsewhere the picks' bytes and block scales gathered and dequantized to the activation dtype
    one projection at a time, then multiplied as the others (the reference)."""
    x, (ids, wts) = ins
    st = be.stacked(node)
    lo, hi = node.attrs.rank_range
    ids, wts = ids[:, lo:hi], wts[:, lo:hi]
    stack_rows = st["local"][ids]
    held = stack_rows >= 0
    stack_rows = stack_rows.clamp(min=0).reshape(-1)
    t, k = ids.shape
    if isinstance(st["gate"], Fp8Weight) and picks_fused(x):  # one kernel per projection reads the picks' bytes
        h = F.silu(picked_linear(x, st["gate"], stack_rows, k)) * picked_linear(x, st["up"], stack_rows, k)  # [t*k, I]
        y = picked_linear(h, st["down"], stack_rows, 1).float()  # [t*k, H]
    else:
        xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [t*k, H, 1]
        h = F.silu(torch.bmm(_picked(st["gate"], stack_rows, x.dtype), xs))  # [t*k, I, 1]
        h = h * torch.bmm(_picked(st["up"], stack_rows, x.dtype), xs)
        y = torch.bmm(_picked(st["down"], stack_rows, x.dtype), h)[:, :, 0].float()  # [t*k, H]
    return (y * (wts * held).reshape(-1, 1)).view(t, k, -1).sum(dim=1).to(x.dtype)


#: ops whose torch_ref rule is not graph-safe, and the rule used instead (GPU-placed nodes)
STATIC_RULES: dict[Op, Callable] = {Op.ATTENTION: attention, Op.ROUTED_EXPERTS: routed_experts}


def static_rules(fallback: dict[Op, Callable]) -> dict[Op, Callable]:
    """Rules for an engine's rule table (torch_ref.TorchRefBackend.rules): a GPU-placed node of
    an op in STATIC_RULES, in a step with the position as a tensor (`ctx.position_t`), runs the
    static-shape rule; any other node `fallback`'s rule for its op."""

    def rule_for(op: Op) -> Callable:
        static, other = STATIC_RULES[op], fallback[op]

        def rule(be, node, w, ins, ctx, dev):
            if ctx.position_t is not None and node.place is not None and node.place.device == Device.GPU:
                return static(be, node, w, ins, ctx, dev)
            return other(be, node, w, ins, ctx, dev)

        return rule

    return {op: rule_for(op) for op in STATIC_RULES}


def fuse_weights(graph: Graph, weights: dict) -> None:
    """The layouts the fused decode rules read, made once the weights are ready: each GPU-placed
    attention layer's input projections as one matrix (attention_gpu.fuse_qkv), in `weights`
    (an engine's, by node_key)."""
    for n in graph.nodes:
        if n.op == Op.ATTENTION and n.place is not None and n.place.device == Device.GPU \
                and node_key(n) in weights:
            attention_gpu.fuse_qkv(weights[node_key(n)], n.attrs.kind)
