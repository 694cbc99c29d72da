"""The reference backend: every op in plain torch, on any device. It is the correctness oracle
the other backends are tested against, so it is written for clarity, one rule per op (RULES).

Activations are [tokens, features] with tokens = batch * seq (row-major over batch). Weights are
taken from the checkpoint's memory map as they are when dtype and device already match (no copy),
else converted once in `prepare`. A node runs on the torch device of its placement (GPU-placed
nodes on `gpu_device`, which is "cpu" where no GPU is present); inputs produced on the other
device arrive through the plan's copy nodes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import rope as rope_mod
from ..errors import KtflowError
from ..ir.graph import Graph, Node
from ..ir.ops import AttentionAttrs, GateAttrs, Op
from ..ir.types import Device
from ..weights import WeightSource
from .base import StepContext

Weights = dict[str, Any]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def linear(x: torch.Tensor, w: Weights, role: str) -> torch.Tensor:
    return F.linear(x, w[role], w.get(role + "_bias"))


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, position: int,
                     window: int) -> torch.Tensor:
    """q [B,h,S,d] at positions position.., k/v [B,h,L,d] at positions 0..L-1 -> [B,S,h*dv]."""
    s, L = q.shape[2], k.shape[2]
    qpos = torch.arange(position, position + s, device=q.device)[:, None]
    kpos = torch.arange(L, device=q.device)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= (qpos - kpos) < window
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(p, v)  # [B,h,S,dv]
    return out.transpose(1, 2).reshape(q.shape[0], s, -1)


class TorchRefBackend:
    name = "torch_ref"

    def __init__(self, gpu_device: str = "cpu", dtype: torch.dtype = torch.float32, options: Any = None):
        self.devices = {Device.CPU: torch.device("cpu"), Device.GPU: torch.device(gpu_device)}
        self.dtype = dtype
        self.weights: dict[str, Weights] = {}
        self._inv_freq: dict[Any, torch.Tensor] = {}

    def device_of(self, node: Node) -> torch.device:
        return self.devices[node.place.device] if node.place is not None else self.devices[Device.CPU]

    # ------------------------------------------------------------------------------ weights
    def _ready(self, t: torch.Tensor, dev: torch.device) -> torch.Tensor:
        if t.dtype == self.dtype and t.device == dev:
            return t
        return t.to(device=dev, dtype=self.dtype)

    def prepare(self, graph: Graph, weights: WeightSource | None) -> None:
        todo = [n for n in graph.nodes if n.weights and n.name not in self.weights]
        if todo and weights is None:
            raise KtflowError("this model was loaded without weights (config.json only): it can be compiled "
                              "but not run; point ktflow at a checkpoint dir with *.safetensors")
        from tqdm import tqdm

        # a bar (on stderr) when there is enough to copy to be worth watching
        copying = sum(n.weight_elems() for n in todo if self.device_of(n).type != "cpu") > 2e8
        for n in tqdm(todo, desc="weights", unit="node", disable=not copying, leave=False):
            w: Weights = {}
            dev = self.device_of(n)
            for ref in n.weights:
                if ref.experts:  # only the experts (and the intermediate rows) this node holds
                    rows = slice(*n.attrs.rows)
                    index = (slice(None), rows) if ref.role == "down" else (rows,)
                    w[ref.role] = {e: self._ready(weights.load_expert(ref, e)[index], dev) for e in n.attrs.ids}
                else:
                    w[ref.role] = self._ready(weights.load(ref), dev)
            self.weights[n.name] = w

    # ------------------------------------------------------------------------------ dispatch
    def run(self, node: Node, inputs: list[Any], ctx: StepContext) -> Any:
        dev = self.device_of(node)
        return RULES[node.op](self, node, self.weights.get(node.name, {}), inputs, ctx, dev)

    def rope_tables(self, attrs: AttentionAttrs, ctx: StepContext, dev: torch.device):
        key = (attrs.rope, dev)
        if key not in self._inv_freq:
            self._inv_freq[key] = rope_mod.inv_freq(attrs.rope).to(dev)
        pos = torch.arange(ctx.position, ctx.position + ctx.seq, device=dev)
        return rope_mod.cos_sin(attrs.rope, self._inv_freq[key], pos, self.dtype)

    def cache(self, ctx: StepContext, attrs: AttentionAttrs, dev: torch.device) -> tuple[torch.Tensor, ...]:
        """This layer's static KV cache in the sequence state, allocated on first use."""
        caches = ctx.state.kv
        if attrs.layer not in caches:
            b, m = ctx.batch, ctx.state.max_seq_len
            kw = dict(device=dev, dtype=self.dtype)
            if attrs.kind == "mla":
                caches[attrs.layer] = (torch.zeros(b, m, attrs.kv_lora_rank, **kw),
                                       torch.zeros(b, m, attrs.qk_rope_dim, **kw))
            else:
                caches[attrs.layer] = (torch.zeros(b, attrs.kv_heads, m, attrs.head_dim, **kw),
                                       torch.zeros(b, attrs.kv_heads, m, attrs.head_dim, **kw))
        return caches[attrs.layer]


# ------------------------------------------------------------------------------------ op rules


def _to(v: Any, dev: torch.device) -> Any:
    """A value on `dev` (routings are (ids, weights) pairs)."""
    if isinstance(v, tuple):
        return tuple(_to(t, dev) for t in v)
    return v if v.device == dev else v.to(dev)


def _copy(be, node, w, ins, ctx, dev):
    return _to(ins[0], dev)


def _submit(be, node, w, ins, ctx, dev):
    return None  # the task runs as its own step; an asynchronous backend enqueues it here


def _sync(be, node, w, ins, ctx, dev):
    return ins[1]


def _input(be, node, w, ins, ctx, dev):
    return ctx.token_ids.to(dev)


def _embed(be, node, w, ins, ctx, dev):
    return F.embedding(ins[0], w["weight"])


def _rmsnorm(be, node, w, ins, ctx, dev):
    return rms_norm(ins[0], w["weight"], node.attrs.eps)


def gqa_project(a: AttentionAttrs, w, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [B,S,H] -> q [B,S,heads,d], k and v [B,S,kv_heads,d]: projections, q/k norms, rope."""
    b, s = x.shape[:2]
    q = linear(x, w, "q").view(b, s, a.heads, a.head_dim)
    k = linear(x, w, "k").view(b, s, a.kv_heads, a.head_dim)
    v = linear(x, w, "v").view(b, s, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = rms_norm(q, w["q_norm"], a.norm_eps), rms_norm(k, w["k_norm"], a.norm_eps)
    return rope_mod.apply(q, cos, sin, a.rope.pairs), rope_mod.apply(k, cos, sin, a.rope.pairs), v


def _gqa(be, a: AttentionAttrs, w, x, ctx, dev):
    b, s, p = ctx.batch, ctx.seq, ctx.position
    q, k, v = gqa_project(a, w, x.view(b, s, -1), *be.rope_tables(a, ctx, dev))
    kc, vc = be.cache(ctx, a, dev)
    kc[:, :, p:p + s] = k.transpose(1, 2)
    vc[:, :, p:p + s] = v.transpose(1, 2)
    rep = a.heads // a.kv_heads
    keys = kc[:, :, :p + s].repeat_interleave(rep, dim=1)
    vals = vc[:, :, :p + s].repeat_interleave(rep, dim=1)
    out = causal_attention(q.transpose(1, 2), keys, vals, a.softmax_scale, p, a.window)
    return linear(out, w, "o").view(b * s, -1)


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
    return (q[..., :nope], rope_mod.apply(q[..., nope:], cos, sin, a.rope.pairs), latent,
            rope_mod.apply(k_rope, cos, sin, a.rope.pairs))


def _mla(be, a: AttentionAttrs, w, x, ctx, dev):
    b, s, p = ctx.batch, ctx.seq, ctx.position
    nope, rdim, vd = a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim
    q_nope, q_rope, latent, k_rope = mla_project(a, w, x.view(b, s, -1), *be.rope_tables(a, ctx, dev))
    lc, rc = be.cache(ctx, a, dev)
    lc[:, p:p + s] = latent
    rc[:, p:p + s] = k_rope[:, :, 0]
    kvb = F.linear(lc[:, :p + s], w["kv_b"]).view(b, p + s, a.heads, nope + vd)
    k_nope, v = kvb[..., :nope].transpose(1, 2), kvb[..., nope:].transpose(1, 2)  # [B,h,L,*]
    keys = torch.cat([k_nope, rc[:, None, :p + s].expand(b, a.heads, p + s, rdim)], dim=-1)
    queries = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
    out = causal_attention(queries, keys, v, a.softmax_scale, p, 0)
    return linear(out, w, "o").view(b * s, -1)


def _attention(be, node, w, ins, ctx, dev):
    fn = _mla if node.attrs.kind == "mla" else _gqa
    return fn(be, node.attrs, w, ins[0], ctx, dev)


def route(a: GateAttrs, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Router math shared by all families: (ids [T,k] int64, weights [T,k] f32), by weight desc."""
    logits = F.linear(x.float(), weight.float())
    scores = logits.sigmoid() if a.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias.float() if bias is not None else scores
    if a.select != "greedy":
        t = x.shape[0]
        grouped = choice.view(t, a.groups, a.experts // a.groups)
        if a.select == "group_max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(a.topk_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(a.experts // a.groups, dim=1), float("-inf"))
    ids = choice.topk(a.top_k, dim=-1).indices
    wts = scores.gather(1, ids)
    if a.renormalize:
        wts = wts / wts.sum(dim=-1, keepdim=True)
    wts = wts * a.scale
    order = wts.argsort(dim=-1, descending=True, stable=True)
    return ids.gather(1, order), wts.gather(1, order)


def _gate(be, node, w, ins, ctx, dev):
    return route(node.attrs, ins[0], w["weight"], w.get("correction_bias"))


def _mlp(be, node, w, ins, ctx, dev):
    x = ins[0]
    y = swiglu(x, w["gate"], w["up"], w["down"])
    if node.attrs.sigmoid_gate:
        y = torch.sigmoid(F.linear(x, w["sigmoid_gate"])) * y
    return y


def _routed_experts(be, node, w, ins, ctx, dev):
    x, (ids, wts) = ins
    lo, hi = node.attrs.rank_range  # the gate sorts each token's picks by weight: slot = rank
    ids, wts = ids[:, lo:hi], wts[:, lo:hi]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    held = w["gate"]
    for e in ids.unique().tolist():
        if e not in held:
            continue  # another node (placed elsewhere) computes this expert
        rows, slot = torch.where(ids == e)
        y = swiglu(x[rows], w["gate"][e], w["up"][e], w["down"][e])
        out.index_add_(0, rows, y.float() * wts[rows, slot, None])
    return out.to(x.dtype)


def _add(be, node, w, ins, ctx, dev):
    out = ins[0]
    for t in ins[1:]:
        out = out + t
    return out


def _reduce(be, node, w, ins, ctx, dev):
    out = ins[0].float()
    for t in ins[1:]:
        out = out + t.float()
    return out.to(ins[0].dtype)


def _lm_head(be, node, w, ins, ctx, dev):
    return F.linear(ins[0], w["weight"]).float()


RULES: dict[Op, Callable] = {
    Op.INPUT: _input, Op.EMBED: _embed, Op.RMSNORM: _rmsnorm, Op.ATTENTION: _attention, Op.GATE: _gate,
    Op.MLP: _mlp, Op.ROUTED_EXPERTS: _routed_experts, Op.ADD: _add, Op.LM_HEAD: _lm_head,
    Op.COPY: _copy, Op.SUBMIT: _submit, Op.SYNC: _sync, Op.REDUCE: _reduce, Op.DEFER: _reduce,
}
