"""DeepSeek-V3 / R1 and Kimi-K2 (model_type deepseek_v3, kimi_k2).

MLA attention (optional q LoRA, compressed KV latent, rope/nope split, yarn with DeepSeek's
softmax mscale, interleaved rope pairs when `rope_interleave`). MoE from layer
`first_k_dense_replace` on: sigmoid scores, `e_score_correction_bias` for the choice, groups
ranked by the sum of their two best biased scores, `topk_group` groups kept, weights
renormalised if `norm_topk_prob`, times `routed_scaling_factor`; shared experts of
`n_shared_experts * moe_intermediate_size`. The multi-token-prediction layer
(`num_nextn_predict_layers`: 1, `model.layers.<num_hidden_layers>.*`) is a graph of its own
(`build_mtp`, frontend/spec.py's `mtp`); the main graph reads none of its tensors.
"""

from __future__ import annotations

from pydantic import Field

from ktflow.frontend.config import HFConfig, parse_config, resolve_rope, yarn_softmax_mscale
from ktflow.ir.graph import Graph
from ktflow.ir.ops import GateAttrs
from ktflow.ir.types import DType
from ktflow.frontend import spec


class V3FfnConfig(HFConfig):
    """The fields of DeepSeek-V3's feed-forward (`v3_ffn`), which GLM-4.5 shares."""

    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    #: multi-token-prediction layers stored after the main ones (the releases have one; `Model.mtp()`
    #: builds the first)
    num_nextn_predict_layers: int = Field(0, ge=0)


class Config(V3FfnConfig):
    kv_lora_rank: int
    q_lora_rank: int | None = None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rope_interleave: bool = True


def config(raw: dict, where: str) -> Config:
    cfg = parse_config(Config, raw, where)
    from ktflow.errors import ConfigError

    if cfg.scoring_func != "sigmoid":
        raise ConfigError(f"{where}: scoring_func {cfg.scoring_func!r} is not supported for deepseek_v3 (sigmoid)")
    if cfg.topk_method != "noaux_tc":  # the groups' top-2 sums with the correction bias: what the spec builds
        raise ConfigError(f"{where}: topk_method {cfg.topk_method!r} is not supported for deepseek_v3 (noaux_tc)")
    return cfg


def v3_ffn(cfg):
    """The feed-forward of layer i in DeepSeek-V3's style (GLM-4.5 shares it): dense before
    `first_k_dense_replace`, then sigmoid-routed experts with the correction bias and groups,
    plus shared experts. `cfg`: a `V3FfnConfig`."""
    h = cfg.hidden_size
    gate_attrs = GateAttrs(hidden=h, experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                           select="group_top2sum", groups=cfg.n_group or 1, topk_groups=cfg.topk_group or 1,
                           correction_bias=True, renormalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)

    def ffn(b, i, x):
        p = f"{spec.layer_prefix(i)}.mlp"
        if i < cfg.first_k_dense_replace:
            return [spec.mlp(b, f"L{i}.mlp", x, h, cfg.intermediate_size, p, "dense")]
        return spec.moe_ffn(b, i, x, gate_attrs, cfg.moe_intermediate_size, p, shared_key="shared_experts",
                            shared_inter=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0))

    return ffn


def _attention(cfg: Config):
    rope = resolve_rope(cfg, cfg.qk_rope_head_dim, "interleaved" if cfg.rope_interleave else "half")
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * yarn_softmax_mscale(cfg)

    def attention(b, i, x):
        return spec.mla_attention(b, f"L{i}.attn", x, cfg, i, rope=rope, softmax_scale=scale)

    return attention


def build(cfg: Config, act_dtype: DType) -> Graph:
    return spec.decoder(cfg, act_dtype, _attention(cfg), v3_ffn(cfg))


def build_mtp(cfg: Config, act_dtype: DType, has) -> Graph | None:
    return v3_mtp(cfg, act_dtype, _attention(cfg), has)


def v3_mtp(cfg, act_dtype: DType, attention, has) -> Graph | None:
    """The MTP layer's graph (spec.mtp) with `attention` and DeepSeek-V3's feed-forward (GLM-4.5
    shares both the layout and the feed-forward), or None where the config declares none."""
    if not cfg.num_nextn_predict_layers:
        return None
    return spec.mtp(cfg, act_dtype, attention, v3_ffn(cfg), has)
