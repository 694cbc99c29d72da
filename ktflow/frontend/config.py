"""Reading an HF `config.json` into a typed model config.

Each family in `ktflow.models` declares a pydantic subclass of `HFConfig` with the fields it
needs; `parse_config` turns validation errors into one message naming the file, the field and
the family. RoPE settings are resolved here from either config style: classic `rope_theta` +
`rope_scaling`, or transformers-5 `rope_parameters`.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ConfigError
from ..ir.ops import RopeAttrs
from ..ir.types import DTYPE_BY_NAME, DType

SUPPORTED_ROPE = ("default", "linear", "yarn")

#: dtype names of config.json (and of the `dtype` compile option) -> IR dtype


class HFConfig(BaseModel):
    """Fields every family shares. Unknown keys of config.json are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    dtype: str | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    original_max_position_embeddings: int | None = None
    hidden_act: str = "silu"
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    #: rope theta when the config gives none (family default, as in transformers)
    default_rope_theta: float = 10000.0

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def weight_dtype(self) -> DType:
        name = (self.dtype or self.torch_dtype or "bfloat16").replace("torch.", "")
        if name not in DTYPE_BY_NAME:
            raise ConfigError(f"config.json: dtype {name!r} is not supported; use bfloat16, float16 or float32")
        return DTYPE_BY_NAME[name]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)


C = TypeVar("C", bound=HFConfig)


def parse_config(cls: type[C], raw: dict, where: str) -> C:
    """Validate `raw` (a parsed config.json) as `cls`; errors name the field and the file."""
    try:
        cfg = cls.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            if err["type"] == "missing":
                problems.append(f"missing required field {field!r}")
            else:
                problems.append(f"field {field!r}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError(f"{where}: {'; '.join(problems)} (model_type {raw.get('model_type')!r})") from None
    if cfg.hidden_act != "silu":
        raise ConfigError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported (only silu)")
    problems = [f"field {name!r} must be an integer, got {raw[name]!r}" for name in POSITIVE
                if isinstance(raw.get(name), (bool, str, float))]  # pydantic reads true as 1, "4" and 4.0 as 4
    problems = problems or semantic_problems(cfg)
    if problems:
        raise ConfigError(f"{where}: {'; '.join(problems)} (model_type {raw.get('model_type')!r})")
    return cfg


#: counts that must be >= 1 where a family's config has them (None: the field is unset)
POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
            "num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok", "n_group", "topk_group",
            "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "max_position_embeddings",
            "decoder_sparse_step")
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")
#: upper bounds far past any real model: a config beyond them is damaged, not big
MAXIMA = {"vocab_size": 1 << 24, "hidden_size": 1 << 20, "intermediate_size": 1 << 20,
          "moe_intermediate_size": 1 << 20, "shared_expert_intermediate_size": 1 << 20, "num_hidden_layers": 4096,
          "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 4096, "num_experts": 4096,
          "n_routed_experts": 4096, "num_local_experts": 4096, "num_experts_per_tok": 4096,
          "n_group": 4096, "topk_group": 4096, "kv_lora_rank": 1 << 16, "qk_rope_head_dim": 4096,
          "qk_nope_head_dim": 4096, "v_head_dim": 4096, "max_position_embeddings": 1 << 26,
          "decoder_sparse_step": 4096}


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def semantic_problems(cfg: HFConfig) -> list[str]:
    """What a config that parsed still gets wrong: each problem names the field, its value and
    the rule (counts positive; heads divisible by kv heads; top-k within the experts; expert
    groups that divide the experts and hold the picked groups)."""
    out = []

    def val(name: str):
        v = getattr(cfg, name, None)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    for name in POSITIVE:
        v = getattr(cfg, name, None)
        if isinstance(v, bool) or (v is not None and not isinstance(v, int)):
            out.append(f"field {name!r} must be an integer, got {v!r}")
        elif v is not None and v < 1:
            out.append(f"field {name!r} must be >= 1, got {v}")
        elif v is not None and v > MAXIMA.get(name, v):
            out.append(f"field {name!r} is {v}, past any real model (at most {MAXIMA[name]}): a damaged config?")
    if out:
        return out
    heads, kv = val("num_attention_heads"), val("num_key_value_heads")
    if heads and kv and heads % kv:
        out.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    hidden = val("hidden_size")
    if getattr(cfg, "head_dim", None) is None and getattr(cfg, "kv_lora_rank", None) is None \
            and hidden and heads and hidden < heads:  # (MLA's head sizes are fields of their own)
        out.append(f"hidden_size {hidden} over num_attention_heads {heads} leaves a head dimension of 0: "
                   "set head_dim or fix those two")
    experts = next((val(n) for n in _EXPERTS if val(n) is not None), None)
    topk = val("num_experts_per_tok")
    if experts is not None and topk is not None and topk > experts:
        out.append(f"num_experts_per_tok {topk} is more than the {experts} experts")
    layers = val("num_hidden_layers")
    first = getattr(cfg, "first_k_dense_replace", None)
    if _is_count(first) and layers and not 0 <= first <= layers:
        out.append(f"first_k_dense_replace {first} is not within 0..{layers} (num_hidden_layers)")
    freq = getattr(cfg, "moe_layer_freq", None)
    if _is_count(freq) and freq < 1:
        out.append(f"moe_layer_freq must be >= 1, got {freq}")
    only = getattr(cfg, "mlp_only_layers", None)
    if isinstance(only, (list, tuple)) and layers:
        bad = [i for i in only if not _is_count(i) or not 0 <= i < layers]
        if bad:
            out.append(f"mlp_only_layers {bad} are not layer indices 0..{layers - 1}")
    groups, topk_group = val("n_group"), val("topk_group")
    if groups and experts is not None and experts % groups:
        out.append(f"the {experts} experts do not divide into n_group {groups} groups")
    if groups and topk_group and topk_group > groups:
        out.append(f"topk_group {topk_group} is more than n_group {groups}")
    scaling = cfg.rope_parameters or cfg.rope_scaling
    for name, v in (("rms_norm_eps", cfg.rms_norm_eps), ("rope_theta", cfg.rope_theta),
                    ("routed_scaling_factor", getattr(cfg, "routed_scaling_factor", None)),
                    ("rope_scaling.factor", scaling.get("factor") if isinstance(scaling, dict) else None),
                    ("rope_parameters.rope_theta", scaling.get("rope_theta") if isinstance(scaling, dict) else None)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            out.append(f"field {name!r} must be a finite number > 0, got {v!r}")
    vocab = val("vocab_size")
    for e in cfg.eos_ids:
        if not _is_count(e) or e < 0 or (vocab is not None and e >= vocab):
            out.append(f"eos_token_id {e!r} is not a token id in 0..{vocab - 1 if vocab else '?'}")
    return out


def rope_params(cfg: HFConfig) -> dict[str, Any]:
    """The rope settings as one flat dict with `rope_type` and `rope_theta`, from either style."""
    p = dict(cfg.rope_parameters or cfg.rope_scaling or {})
    if any(isinstance(v, dict) for v in p.values()):
        raise ConfigError("config.json: per-layer-type rope_parameters are not supported")
    p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
    if p.get("rope_theta") is None:
        p["rope_theta"] = cfg.rope_theta if cfg.rope_theta is not None else cfg.default_rope_theta
    return p


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def resolve_rope(cfg: HFConfig, dim: int, pairs: str = "half") -> RopeAttrs:
    """RoPE attrs for rotary dimension `dim` (the same algorithm transformers uses)."""
    p = rope_params(cfg)
    kind = p["rope_type"]
    if kind not in SUPPORTED_ROPE:
        raise ConfigError(f"config.json: rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE)}")
    theta = float(p["rope_theta"])
    if kind == "default":
        return RopeAttrs(dim=dim, theta=theta, pairs=pairs)
    if p.get("factor") is None and kind == "linear":
        raise ConfigError("config.json: linear rope scaling needs 'factor'")
    if kind == "linear":
        return RopeAttrs(dim=dim, theta=theta, kind="linear", pairs=pairs, factor=float(p["factor"]))
    orig = p.get("original_max_position_embeddings") or cfg.original_max_position_embeddings \
        or cfg.max_position_embeddings
    factor = p.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position_embeddings / orig
    att = p.get("attention_factor")
    if att is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        att = _mscale(factor, ms) / _mscale(factor, ms_all) if ms and ms_all else _mscale(factor)
    return RopeAttrs(dim=dim, theta=theta, kind="yarn", pairs=pairs, factor=factor,
                     original_max_position=int(orig), beta_fast=float(p.get("beta_fast") or 32),
                     beta_slow=float(p.get("beta_slow") or 1), truncate=bool(p.get("truncate", True)),
                     attention_factor=float(att))


def yarn_softmax_mscale(cfg: HFConfig) -> float:
    """DeepSeek's extra softmax scale: mscale(factor, mscale_all_dim)^2 when rope is scaled."""
    p = rope_params(cfg)
    if p["rope_type"] == "default" or not p.get("mscale_all_dim"):
        return 1.0
    m = _mscale(float(p["factor"]), float(p["mscale_all_dim"]))
    return m * m
