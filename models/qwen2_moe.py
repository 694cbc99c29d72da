"""Qwen1.5-MoE and Qwen2-MoE (model_type qwen2_moe).

GQA attention with q/k/v bias (`qkv_bias`, default true), rope on half pairs. MoE on layers
where (i+1) % decoder_sparse_step == 0 and i is not in `mlp_only_layers`: softmax top-k,
renormalised if `norm_topk_prob`; a shared expert scaled by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

from pydantic import Field

from ktflow.frontend.config import HFConfig, parse_config, resolve_rope
from ktflow.errors import ConfigError
from ktflow.ir.graph import Graph
from ktflow.ir.ops import GateAttrs
from ktflow.ir.types import DType
from ktflow.frontend import spec


class Config(HFConfig):
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int = 0
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = Field(default_factory=list)
    qkv_bias: bool = True
    use_sliding_window: bool = False


def config(raw: dict, where: str) -> Config:
    cfg = parse_config(Config, raw, where)
    if cfg.use_sliding_window:
        raise ConfigError(f"{where}: use_sliding_window=true is not supported for qwen2_moe")
    return cfg


def is_moe_layer(cfg, i: int) -> bool:
    return i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0


def build(cfg: Config, act_dtype: DType) -> Graph:
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    rope = resolve_rope(cfg, hd)
    h = cfg.hidden_size
    gate_attrs = GateAttrs(hidden=h, experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                           renormalize=cfg.norm_topk_prob)

    def attention(b, i, x):
        return spec.gqa_attention(b, f"L{i}.attn", x, cfg, i, head_dim=hd, qkv_bias=cfg.qkv_bias, o_bias=False,
                                  qk_norm=False, window=0, rope=rope)

    def ffn(b, i, x):
        p = f"{spec.layer_prefix(i)}.mlp"
        if not is_moe_layer(cfg, i):
            return [spec.mlp(b, f"L{i}.mlp", x, h, cfg.intermediate_size, p, "dense")]
        return spec.moe_ffn(b, i, x, gate_attrs, cfg.moe_intermediate_size, p, shared_key="shared_expert",
                            shared_inter=cfg.shared_expert_intermediate_size,
                            shared_gate_key=f"{p}.shared_expert_gate.weight")

    return spec.decoder(cfg, act_dtype, attention, ffn)
