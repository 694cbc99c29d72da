"""Building blocks the model specs in `ktflow.models` compose.

A family's `build(cfg)` calls `decoder(...)` with two callbacks, one that adds a layer's
attention and one that adds its feed-forward block; everything else (embedding, norms, the
residual stream, lm_head, node names, checkpoint key names of the common parts) is shared.

Node names: tokens, embed, L<i>.attn_norm, L<i>.attn, L<i>.attn_res, L<i>.ffn_norm, then
L<i>.mlp (dense) or L<i>.gate, L<i>.experts, L<i>.shared (MoE), L<i>.ffn_res, norm, lm_head.

`mtp(...)` builds a family's multi-token-prediction layer (DeepSeek-V3, GLM-4.5) as a graph of its
own: tokens, hidden (the main model's final normalised hidden state), embed, mtp.enorm,
mtp.hnorm, mtp.proj, then layer L's nodes (L = num_hidden_layers), norm, lm_head.
"""

from __future__ import annotations

from typing import Callable

from .config import HFConfig
from ..ir.graph import Graph, GraphBuilder
from ..ir.ops import (AddAttrs, AttentionAttrs, EmbedAttrs, GateAttrs, InputAttrs, LMHeadAttrs, MLPAttrs, Op,
    ProjectAttrs, RMSNormAttrs, RoutedExpertsAttrs)
from ..ir.types import DType, WeightRef

W = WeightRef


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def norm(b: GraphBuilder, name: str, x: str, dim: int, eps: float, key: str) -> str:
    return b.add(name, Op.RMSNORM, [x], RMSNormAttrs(dim, eps), [W("weight", key, (dim,))])


def linear_refs(role: str, key: str, out_dim: int, in_dim: int, bias: bool) -> list[WeightRef]:
    refs = [W(role, f"{key}.weight", (out_dim, in_dim))]
    if bias:
        refs.append(W(role + "_bias", f"{key}.bias", (out_dim,)))
    return refs


def mlp(b: GraphBuilder, name: str, x: str, hidden: int, inter: int, key: str, kind: str,
        sigmoid_gate_key: str | None = None) -> str:
    refs = [W("gate", f"{key}.gate_proj.weight", (inter, hidden)),
            W("up", f"{key}.up_proj.weight", (inter, hidden)),
            W("down", f"{key}.down_proj.weight", (hidden, inter))]
    if sigmoid_gate_key:
        refs.append(W("sigmoid_gate", sigmoid_gate_key, (1, hidden)))
    return b.add(name, Op.MLP, [x], MLPAttrs(kind, hidden, inter, sigmoid_gate_key is not None), refs)


def gate(b: GraphBuilder, name: str, x: str, attrs: GateAttrs, key: str) -> str:
    refs = [W("weight", f"{key}.weight", (attrs.experts, attrs.hidden))]
    if attrs.correction_bias:
        refs.append(W("correction_bias", f"{key}.e_score_correction_bias", (attrs.experts,)))
    return b.add(name, Op.GATE, [x], attrs, refs)


def routed_experts(b: GraphBuilder, name: str, x: str, route: str, layer: int, hidden: int, inter: int,
                   experts: int, top_k: int, key: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> str:
    """`key` is the experts prefix (`model.layers.N.mlp.experts`); `names` the per-expert
    projection names for gate, up and down (Mixtral: w1, w3, w2)."""
    g, u, d = names
    refs = [W("gate", f"{key}.{{e}}.{g}.weight", (inter, hidden), experts),
            W("up", f"{key}.{{e}}.{u}.weight", (inter, hidden), experts),
            W("down", f"{key}.{{e}}.{d}.weight", (hidden, inter), experts)]
    return b.add(name, Op.ROUTED_EXPERTS, [x, route], RoutedExpertsAttrs(layer, hidden, inter, experts, top_k), refs)


def moe_ffn(b: GraphBuilder, i: int, x: str, gate_attrs: GateAttrs, inter: int, key: str, *,
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), shared_inter: int = 0,
            shared_key: str = "", shared_gate_key: str | None = None) -> list[str]:
    """Layer i's MoE block under checkpoint prefix `key` (`model.layers.N.mlp`): router
    `L<i>.gate`, routed experts `L<i>.experts` and, when `shared_inter`, a shared expert
    `L<i>.shared` (optionally sigmoid-gated). Returns the names to add to the residual."""
    r = gate(b, f"L{i}.gate", x, gate_attrs, f"{key}.gate")
    parts = [routed_experts(b, f"L{i}.experts", x, r, i, gate_attrs.hidden, inter, gate_attrs.experts,
                            gate_attrs.top_k, f"{key}.experts", names)]
    if shared_inter:
        parts.append(mlp(b, f"L{i}.shared", x, gate_attrs.hidden, shared_inter, f"{key}.{shared_key}", "shared",
                         sigmoid_gate_key=shared_gate_key))
    return parts


def gqa_attention(b: GraphBuilder, name: str, x: str, cfg: HFConfig, layer: int, *, head_dim: int,
                  qkv_bias: bool, o_bias: bool, qk_norm: bool, window: int, rope) -> str:
    h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads
    key = f"{layer_prefix(layer)}.self_attn"
    refs = (linear_refs("q", f"{key}.q_proj", nh * head_dim, h, qkv_bias)
            + linear_refs("k", f"{key}.k_proj", nkv * head_dim, h, qkv_bias)
            + linear_refs("v", f"{key}.v_proj", nkv * head_dim, h, qkv_bias)
            + linear_refs("o", f"{key}.o_proj", h, nh * head_dim, o_bias))
    if qk_norm:
        refs += [W("q_norm", f"{key}.q_norm.weight", (head_dim,)), W("k_norm", f"{key}.k_norm.weight", (head_dim,))]
    attrs = AttentionAttrs(kind="gqa", layer=layer, hidden=h, heads=nh, rope=rope, softmax_scale=head_dim ** -0.5,
                           kv_heads=nkv, head_dim=head_dim, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                           window=window, norm_eps=cfg.rms_norm_eps)
    return b.add(name, Op.ATTENTION, [x], attrs, refs)


def mla_attention(b: GraphBuilder, name: str, x: str, cfg, layer: int, *, rope, softmax_scale: float) -> str:
    """DeepSeek MLA. `cfg` needs q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim and attention_bias."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    ql, kvl = cfg.q_lora_rank or 0, cfg.kv_lora_rank
    nope, rdim, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    qk = nope + rdim
    bias = bool(cfg.attention_bias)
    key = f"{layer_prefix(layer)}.self_attn"
    if ql:
        refs = (linear_refs("q_a", f"{key}.q_a_proj", ql, h, bias)
                + [W("q_a_norm", f"{key}.q_a_layernorm.weight", (ql,))]
                + linear_refs("q_b", f"{key}.q_b_proj", nh * qk, ql, False))
    else:
        refs = linear_refs("q", f"{key}.q_proj", nh * qk, h, False)
    refs += (linear_refs("kv_a", f"{key}.kv_a_proj_with_mqa", kvl + rdim, h, bias)
             + [W("kv_a_norm", f"{key}.kv_a_layernorm.weight", (kvl,))]
             + linear_refs("kv_b", f"{key}.kv_b_proj", nh * (nope + vd), kvl, False)
             + linear_refs("o", f"{key}.o_proj", h, nh * vd, bias))
    attrs = AttentionAttrs(kind="mla", layer=layer, hidden=h, heads=nh, rope=rope, softmax_scale=softmax_scale,
                           qkv_bias=bias, o_bias=bias, q_lora_rank=ql, kv_lora_rank=kvl, qk_nope_dim=nope,
                           qk_rope_dim=rdim, v_head_dim=vd, norm_eps=1e-6)
    return b.add(name, Op.ATTENTION, [x], attrs, refs)


AttnFn = Callable[[GraphBuilder, int, str], str]
FfnFn = Callable[[GraphBuilder, int, str], list[str]]


def decoder(cfg: HFConfig, act_dtype: DType, attention: AttnFn, ffn: FfnFn) -> Graph:
    """The pre-norm decoder stack shared by all families.

    `attention(b, i, x)` adds layer i's attention reading `x` and returns its output name;
    `ffn(b, i, x)` adds layer i's feed-forward block and returns the names to add to the
    residual (one for a dense MLP; routed experts and shared expert for MoE).
    """
    b = GraphBuilder(act_dtype)
    h, v, eps = cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps
    tokens = b.add("tokens", Op.INPUT, [], InputAttrs())
    x = b.add("embed", Op.EMBED, [tokens], EmbedAttrs(v, h), [W("weight", "model.embed_tokens.weight", (v, h))])
    for i in range(cfg.num_hidden_layers):
        x = _layer(b, cfg, i, x, attention, ffn)
    x = norm(b, "norm", x, h, eps, "model.norm.weight")
    out = b.add("lm_head", Op.LM_HEAD, [x], LMHeadAttrs(h, v), [W("weight", head_key(cfg), (v, h))])
    return b.build([out])


def head_key(cfg: HFConfig) -> str:
    """The checkpoint key of the main model's output head."""
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def _layer(b: GraphBuilder, cfg: HFConfig, i: int, x: str, attention: AttnFn, ffn: FfnFn) -> str:
    """Decoder layer i over the residual stream `x` (pre-norm attention, then the feed-forward);
    returns the stream after it."""
    h, eps, p = cfg.hidden_size, cfg.rms_norm_eps, layer_prefix(i)
    a = attention(b, i, norm(b, f"L{i}.attn_norm", x, h, eps, f"{p}.input_layernorm.weight"))
    x = b.add(f"L{i}.attn_res", Op.ADD, [x, a], AddAttrs(i, "attn"))
    parts = ffn(b, i, norm(b, f"L{i}.ffn_norm", x, h, eps, f"{p}.post_attention_layernorm.weight"))
    return b.add(f"L{i}.ffn_res", Op.ADD, [x, *parts], AddAttrs(i, "ffn"))


def mtp(cfg: HFConfig, act_dtype: DType, attention: AttnFn, ffn: FfnFn, has: Callable[[str], bool]) -> Graph:
    """The multi-token-prediction layer L = num_hidden_layers as DeepSeek-V3 publishes it (GLM-4.5
    shares the layout): at position i, from the main model's final normalised hidden state h_i
    (the `hidden` input) and the next token t_{i+1} (the `tokens` input),
    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), then decoder layer L over x (its own KV
    cache, router and experts), then shared_head.norm and the head: logits of token i + 2.

    The embedding and head are the layer's own (`model.layers.L.embed_tokens`,
    `.shared_head.head`) where the checkpoint stores them (`has(key)`), else the main model's,
    which the published architecture shares."""
    h, v, eps, i = cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, cfg.num_hidden_layers
    p = layer_prefix(i)
    b = GraphBuilder(act_dtype)
    tokens = b.add("tokens", Op.INPUT, [], InputAttrs())
    hidden = b.add("hidden", Op.INPUT, [], InputAttrs(hidden=h))
    embed_key = f"{p}.embed_tokens.weight" if has(f"{p}.embed_tokens.weight") else "model.embed_tokens.weight"
    e = b.add("embed", Op.EMBED, [tokens], EmbedAttrs(v, h), [W("weight", embed_key, (v, h))])
    en = norm(b, "mtp.enorm", e, h, eps, f"{p}.enorm.weight")
    hn = norm(b, "mtp.hnorm", hidden, h, eps, f"{p}.hnorm.weight")
    x = b.add("mtp.proj", Op.PROJECT, [en, hn], ProjectAttrs((h, h), h), [W("weight", f"{p}.eh_proj.weight", (h, 2 * h))])
    x = _layer(b, cfg, i, x, attention, ffn)
    x = norm(b, "norm", x, h, eps, f"{p}.shared_head.norm.weight")
    own_head = f"{p}.shared_head.head.weight"
    out = b.add("lm_head", Op.LM_HEAD, [x], LMHeadAttrs(h, v),
                [W("weight", own_head if has(own_head) else head_key(cfg), (v, h))])
    return b.build([out])
