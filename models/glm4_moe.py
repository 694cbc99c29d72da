"""GLM-4.5 / 4.6 and GLM-4.5-Air (model_type glm4_moe).

GQA attention with q/k/v biases (`attention_bias`), optional per-head q/k RMSNorm
(`use_qk_norm`) and partial rotary: rope on the first `partial_rotary_factor` of each head's
dimensions ('half' pairs), the rest passed through (transformers' default factor for this family
is 0.5, read from the top level of config.json or from `rope_parameters`). MoE from layer
`first_k_dense_replace` on, routed as DeepSeek-V3: sigmoid scores, `e_score_correction_bias`
for the choice, groups by the sum of their two best biased scores, weights renormalised if
`norm_topk_prob`, times `routed_scaling_factor`; shared experts of `n_shared_experts *
moe_intermediate_size`. The multi-token-prediction layer (`num_nextn_predict_layers`: 1,
`model.layers.<num_hidden_layers>.*`, DeepSeek-V3's layout) is a graph of its own (`build_mtp`).
"""

from __future__ import annotations

from ktflow.frontend.config import parse_config, resolve_rope, rope_params
from ktflow.errors import ConfigError
from ktflow.ir.graph import Graph
from ktflow.ir.types import DType
from ktflow.frontend import spec

from .deepseek_v3 import V3FfnConfig, v3_ffn, v3_mtp


class Config(V3FfnConfig):
    first_k_dense_replace: int = 1
    use_qk_norm: bool = False
    partial_rotary_factor: float | None = None

    #: transformers' default for the family
    default_rope_theta: float = 10000.0

    @property
    def rotary_factor(self) -> float:
        f = self.partial_rotary_factor
        if f is None:
            f = rope_params(self).get("partial_rotary_factor", 0.5)
        return float(f)


def config(raw: dict, where: str) -> Config:
    cfg = parse_config(Config, raw, where)
    f = cfg.rotary_factor
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    if not 0.0 < f <= 1.0 or int(hd * f) % 2:
        raise ConfigError(f"{where}: partial_rotary_factor {f} must be in (0, 1] and give an even number of "
                          f"rotary dimensions of head_dim {hd} (it gives {int(hd * f)})")
    return cfg


def _attention(cfg: Config):
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    rope = resolve_rope(cfg, int(hd * cfg.rotary_factor))

    def attention(b, i, x):
        return spec.gqa_attention(b, f"L{i}.attn", x, cfg, i, head_dim=hd, qkv_bias=cfg.attention_bias,
                                  o_bias=False, qk_norm=cfg.use_qk_norm, window=0, rope=rope)

    return attention


def build(cfg: Config, act_dtype: DType) -> Graph:
    return spec.decoder(cfg, act_dtype, _attention(cfg), v3_ffn(cfg))


def build_mtp(cfg: Config, act_dtype: DType, has) -> Graph | None:
    return v3_mtp(cfg, act_dtype, _attention(cfg), has)
