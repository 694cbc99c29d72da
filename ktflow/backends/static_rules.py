"""Op rules for a step whose position is a tensor: what a CUDA graph can capture and replay.

torch_ref's rules take the position as a Python int and size everything by it (cache slices
0..p, masks of p + s columns, `unique()` over the routed ids), so each token would need a new
graph. These rules read the position from `ctx.position_t` (a one-element int64 tensor on the
rule's device, rewritten before each replay) and keep every shape static:

- rope: cos/sin rows looked up in a table of all `max_seq_len` positions;
- KV cache: the new rows written with `index_copy_` at the position;
- GQA: `scaled_dot_product_attention` over the whole static cache with a mask of the positions
  reached (and the sliding window);
- MLA, absorbed: the queries are folded into the latent space (q_nope x W_uk), attention runs
  over the compressed cache (normalised latent + roped key) and its output leaves the latent
  space through W_uv, so the per-head keys and values are never expanded;
- GPU-resident routed experts: each token's picks gathered from the node's stacked expert
  weights (picks of experts held elsewhere get weight 0).

They run on any device (tests compare them with torch_ref on the CPU) and are used for decode
steps, the ones captured as graphs. Cache layouts are torch_ref's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import rope as rope_mod
from ..ir.ops import AttentionAttrs, Op
from ..ir.types import Device
from .base import StepContext
from .torch_ref import linear, rms_norm


class RopeTables:
    """cos/sin of every position < max_seq_len, per rope and device (built once)."""

    def __init__(self, max_seq_len: int, dtype: torch.dtype):
        self.max_seq_len, self.dtype = max_seq_len, dtype
        self.tables: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, r, pos: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (r, pos.device)
        if key not in self.tables:
            freqs = rope_mod.inv_freq(r).to(pos.device)
            self.tables[key] = rope_mod.cos_sin(r, freqs, torch.arange(self.max_seq_len, device=pos.device), self.dtype)
        cos, sin = self.tables[key]
        rows = pos + torch.arange(s, device=pos.device)
        return cos.index_select(0, rows), sin.index_select(0, rows)


def _visible(a: AttentionAttrs, pos: torch.Tensor, s: int, length: int) -> torch.Tensor:
    """[s, length] bool: may query i (at pos + i) see cache position j."""
    qpos = (pos + torch.arange(s, device=pos.device))[:, None]
    kpos = torch.arange(length, device=pos.device)[None, :]
    ok = kpos <= qpos
    if a.window:
        ok &= (qpos - kpos) < a.window
    return ok


def gqa(be, a: AttentionAttrs, w, x: torch.Tensor, ctx: StepContext, dev) -> torch.Tensor:
    b, s, pos = ctx.batch, ctx.seq, ctx.position_t
    x = x.view(b, s, -1)
    q = linear(x, w, "q").view(b, s, a.heads, a.head_dim)
    k = linear(x, w, "k").view(b, s, a.kv_heads, a.head_dim)
    v = linear(x, w, "v").view(b, s, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = rms_norm(q, w["q_norm"], a.norm_eps), rms_norm(k, w["k_norm"], a.norm_eps)
    cos, sin = be.rope.at(a.rope, pos, s)
    q, k = rope_mod.apply(q, cos, sin, a.rope.pairs), rope_mod.apply(k, cos, sin, a.rope.pairs)
    kc, vc = be.cache(ctx, a, dev)
    rows = pos + torch.arange(s, device=pos.device)
    kc.index_copy_(2, rows, k.transpose(1, 2))
    vc.index_copy_(2, rows, v.transpose(1, 2))
    mask = _visible(a, pos, s, kc.shape[2])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, attn_mask=mask, scale=a.softmax_scale,
                                         enable_gqa=a.heads != a.kv_heads)
    return linear(out.transpose(1, 2).reshape(b, s, -1), w, "o").view(b * s, -1)


def absorbed_kv_b(a: AttentionAttrs, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [heads * (nope + v), kv_lora_rank] as W_uk [heads, nope, rank] and W_uv [heads, v, rank]."""
    per = kv_b.view(a.heads, a.qk_nope_dim + a.v_head_dim, a.kv_lora_rank)
    return per[:, :a.qk_nope_dim], per[:, a.qk_nope_dim:]


def mla(be, a: AttentionAttrs, w, x: torch.Tensor, ctx: StepContext, dev) -> torch.Tensor:
    b, s, pos = ctx.batch, ctx.seq, ctx.position_t
    nope, rdim, kvl = a.qk_nope_dim, a.qk_rope_dim, a.kv_lora_rank
    x = x.view(b, s, -1)
    if a.q_lora_rank:
        q = linear(rms_norm(linear(x, w, "q_a"), w["q_a_norm"], a.norm_eps), w, "q_b")
    else:
        q = linear(x, w, "q")
    q = q.view(b, s, a.heads, nope + rdim)
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    kv = linear(x, w, "kv_a")
    latent = rms_norm(kv[..., :kvl], w["kv_a_norm"], a.norm_eps)
    k_rope = kv[..., kvl:].view(b, s, 1, rdim)
    cos, sin = be.rope.at(a.rope, pos, s)
    q_rope = rope_mod.apply(q_rope, cos, sin, a.rope.pairs)
    k_rope = rope_mod.apply(k_rope, cos, sin, a.rope.pairs)
    lc, rc = be.cache(ctx, a, dev)
    rows = pos + torch.arange(s, device=pos.device)
    lc.index_copy_(1, rows, latent)
    rc.index_copy_(1, rows, k_rope[:, :, 0])
    w_uk, w_uv = absorbed_kv_b(a, w["kv_b"])
    q_lat = torch.einsum("bshn,hnc->bhsc", q_nope, w_uk)  # queries in the latent space
    scores = torch.matmul(q_lat, lc[:, None].transpose(-1, -2))  # [B,h,s,L]
    scores = scores + torch.matmul(q_rope.transpose(1, 2), rc[:, None].transpose(-1, -2))
    scores = (scores * a.softmax_scale).masked_fill(~_visible(a, pos, s, lc.shape[1]), float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
    o_lat = torch.matmul(p, lc[:, None])  # [B,h,s,rank]
    out = torch.einsum("bhsc,hvc->bshv", o_lat, w_uv).reshape(b, s, -1)
    return linear(out, w, "o").view(b * s, -1)


def attention(be, node, w, ins, ctx, dev):
    return (mla if node.attrs.kind == "mla" else gqa)(be, node.attrs, w, ins[0], ctx, dev)


def stack_experts(w: dict) -> dict:
    """A GPU routed-experts node's weights {role: {expert: tensor}} as stacked tensors and a map
    from expert id to its row in them (-1: held elsewhere)."""
    held = sorted(w["gate"])
    dev = w["gate"][held[0]].device
    experts = max(held) + 1
    local = torch.full((experts,), -1, dtype=torch.int64, device=dev)
    local[torch.tensor(held, device=dev)] = torch.arange(len(held), device=dev)
    return dict(local=local, **{r: torch.stack([w[r][e] for e in held]) for r in ("gate", "up", "down")})


def routed_experts(be, node, w, ins, ctx, dev):
    """Each token's picks in the node's rank range, gathered from the stacked weights (reads
    only the picked experts; no host-side look at the ids)."""
    x, (ids, wts) = ins
    st = be.stacked(node.name, w)
    lo, hi = node.attrs.rank_range
    ids, wts = ids[:, lo:hi], wts[:, lo:hi]
    local = st["local"]
    inside = ids < local.shape[0]
    slot = local[ids.clamp(max=local.shape[0] - 1)]
    held = inside & (slot >= 0)
    slot = slot.clamp(min=0).reshape(-1)
    t, k = ids.shape
    xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [t*k, H, 1]
    h = F.silu(torch.bmm(st["gate"][slot], xs)) * torch.bmm(st["up"][slot], xs)  # [t*k, I, 1]
    y = torch.bmm(st["down"][slot], h)[:, :, 0].float()  # [t*k, H]
    scale = (wts * held).reshape(-1, 1)
    return (y * scale).view(t, k, -1).sum(dim=1).to(x.dtype)


#: ops whose torch_ref rule is not graph-safe, and the rule used instead (GPU-placed nodes)
STATIC_RULES: dict[Op, Callable] = {Op.ATTENTION: attention, Op.ROUTED_EXPERTS: routed_experts}


class StaticRules:
    """Mixin for a TorchRefBackend subclass: GPU-placed nodes of a step with `ctx.position_t` set
    run the rules above; everything else runs as the base class runs it."""

    def static_setup(self, max_seq_len: int) -> None:
        """Rope tables for positions < max_seq_len (earlier, shorter tables stay alive: graphs
        captured before read them)."""
        if getattr(self, "rope", None) is not None:
            self._retired = getattr(self, "_retired", []) + [self.rope]
        self.rope = RopeTables(max_seq_len, self.dtype)
        self._stacked: dict[str, dict] = getattr(self, "_stacked", {})

    def stacked(self, name: str, w: dict) -> dict:
        if name not in self._stacked:
            self._stacked[name] = stack_experts(w)
        return self._stacked[name]

    def run(self, node, inputs: list, ctx: StepContext):
        rule = STATIC_RULES.get(node.op)
        if rule is not None and ctx.position_t is not None and node.place is not None \
                and node.place.device == Device.GPU:
            return rule(self, node, self.weights.get(node.name, {}), inputs, ctx, self.device_of(node))
        return super().run(node, inputs, ctx)
