"""DeepSeek-V2, V2.5 and V2-Lite (model_type deepseek_v2).

MLA attention as in V3 with rope on interleaved pairs. MoE on layers >= `first_k_dense_replace`
(every `moe_layer_freq`-th): softmax scores; `topk_method` greedy (top-k of all) or
group_limited_greedy (groups ranked by their best score, `topk_group` kept). As in the original
model code, weights are renormalised when `norm_topk_prob`, otherwise multiplied by
`routed_scaling_factor`. Shared experts of `n_shared_experts * moe_intermediate_size`.
"""

from __future__ import annotations

from ktflow.frontend.config import HFConfig, parse_config, resolve_rope, yarn_softmax_mscale
from ktflow.errors import ConfigError
from ktflow.ir.graph import Graph
from ktflow.ir.ops import GateAttrs
from ktflow.ir.types import DType
from ktflow.frontend import spec


class Config(HFConfig):
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int | None = None
    kv_lora_rank: int
    q_lora_rank: int | None = None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str = "greedy"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    attention_bias: bool = False
    mlp_bias: bool = False


def config(raw: dict, where: str) -> Config:
    cfg = parse_config(Config, raw, where)
    if cfg.topk_method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"{where}: topk_method {cfg.topk_method!r} is not supported for deepseek_v2 "
                          "(greedy, group_limited_greedy)")
    if cfg.topk_method == "group_limited_greedy" and not (cfg.n_group and cfg.topk_group):
        raise ConfigError(f"{where}: group_limited_greedy needs n_group and topk_group")
    if cfg.scoring_func != "softmax" or cfg.mlp_bias:
        raise ConfigError(f"{where}: only scoring_func softmax and mlp_bias false are supported for deepseek_v2")
    return cfg


def build(cfg: Config, act_dtype: DType) -> Graph:
    rope = resolve_rope(cfg, cfg.qk_rope_head_dim, "interleaved")
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * yarn_softmax_mscale(cfg)
    h, e = cfg.hidden_size, cfg.n_routed_experts
    grouped = cfg.topk_method == "group_limited_greedy"
    gate_attrs = GateAttrs(hidden=h, experts=e, top_k=cfg.num_experts_per_tok, scoring="softmax",
                           select="group_max" if grouped else "greedy",
                           groups=cfg.n_group if grouped else 1, topk_groups=cfg.topk_group if grouped else 1,
                           renormalize=cfg.norm_topk_prob,
                           scale=1.0 if cfg.norm_topk_prob else cfg.routed_scaling_factor)

    def attention(b, i, x):
        return spec.mla_attention(b, f"L{i}.attn", x, cfg, i, rope=rope, softmax_scale=scale)

    def ffn(b, i, x):
        p = f"{spec.layer_prefix(i)}.mlp"
        if i < cfg.first_k_dense_replace or i % cfg.moe_layer_freq:
            return [spec.mlp(b, f"L{i}.mlp", x, h, cfg.intermediate_size, p, "dense")]
        return spec.moe_ffn(b, i, x, gate_attrs, cfg.moe_intermediate_size, p, shared_key="shared_experts",
                            shared_inter=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0))

    return spec.decoder(cfg, act_dtype, attention, ffn)
