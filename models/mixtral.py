"""Mixtral (model_type mixtral): GQA attention without bias, an optional sliding window; every
layer is MoE with softmax top-k, always renormalised. Checkpoint names:
`block_sparse_moe.gate` and `block_sparse_moe.experts.E.w1/w3/w2` (gate/up/down)."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from ktflow.frontend.config import HFConfig, parse_config, resolve_rope
from ktflow.ir.graph import Graph
from ktflow.ir.ops import GateAttrs
from ktflow.ir.types import DType
from ktflow.frontend import spec


class Config(HFConfig):
    intermediate_size: int
    num_local_experts: int = Field(validation_alias=AliasChoices("num_local_experts", "num_experts"))
    num_experts_per_tok: int
    sliding_window: int | None = None
    default_rope_theta: float = 1e6


def config(raw: dict, where: str) -> Config:
    return parse_config(Config, raw, where)


def build(cfg: Config, act_dtype: DType) -> Graph:
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    rope = resolve_rope(cfg, hd)
    h, e = cfg.hidden_size, cfg.num_local_experts
    gate_attrs = GateAttrs(hidden=h, experts=e, top_k=cfg.num_experts_per_tok, renormalize=True)

    def attention(b, i, x):
        return spec.gqa_attention(b, f"L{i}.attn", x, cfg, i, head_dim=hd, qkv_bias=False, o_bias=False,
                                  qk_norm=False, window=cfg.sliding_window or 0, rope=rope)

    def ffn(b, i, x):
        return spec.moe_ffn(b, i, x, gate_attrs, cfg.intermediate_size, f"{spec.layer_prefix(i)}.block_sparse_moe",
                            names=("w1", "w3", "w2"))

    return spec.decoder(cfg, act_dtype, attention, ffn)
