"""Qwen3-MoE (model_type qwen3_moe): Qwen2-MoE without the shared expert, with per-head q/k
RMSNorm and `attention_bias` on all four projections. Expert count from `num_experts` or
`num_local_experts`."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from ktflow.frontend.config import HFConfig, parse_config, resolve_rope
from ktflow.errors import ConfigError
from ktflow.ir.graph import Graph
from ktflow.ir.ops import GateAttrs
from ktflow.ir.types import DType
from ktflow.frontend import spec

from .qwen2_moe import is_moe_layer


class Config(HFConfig):
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int = Field(validation_alias=AliasChoices("num_experts", "num_local_experts"))
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = Field(default_factory=list)
    attention_bias: bool = False
    use_sliding_window: bool = False


def config(raw: dict, where: str) -> Config:
    cfg = parse_config(Config, raw, where)
    if cfg.use_sliding_window:
        raise ConfigError(f"{where}: use_sliding_window=true is not supported for qwen3_moe")
    return cfg


def build(cfg: Config, act_dtype: DType) -> Graph:
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    rope = resolve_rope(cfg, hd)
    h = cfg.hidden_size
    gate_attrs = GateAttrs(hidden=h, experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                           renormalize=cfg.norm_topk_prob)

    def attention(b, i, x):
        return spec.gqa_attention(b, f"L{i}.attn", x, cfg, i, head_dim=hd, qkv_bias=cfg.attention_bias,
                                  o_bias=cfg.attention_bias, qk_norm=True, window=0, rope=rope)

    def ffn(b, i, x):
        p = f"{spec.layer_prefix(i)}.mlp"
        if not is_moe_layer(cfg, i):
            return [spec.mlp(b, f"L{i}.mlp", x, h, cfg.intermediate_size, p, "dense")]
        return spec.moe_ffn(b, i, x, gate_attrs, cfg.moe_intermediate_size, p)

    return spec.decoder(cfg, act_dtype, attention, ffn)
