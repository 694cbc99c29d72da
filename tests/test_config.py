"""config.json reading: family registry, required fields, both rope styles, aliases."""

import json
import re

import pytest

import ktflow
from ktflow.frontend.config import resolve_rope
from ktflow.errors import ConfigError
from ktflow.models import REGISTRY, family
from small_configs import CONFIGS


def write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_a_config_nested_too_deeply_or_not_a_file_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        ktflow.load(tmp_path)
    d = tmp_path / "dir"
    (d / "config.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match="is not a regular file"):
        ktflow.load(d)


def test_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        ktflow.load(f)
    with pytest.raises(ConfigError, match="does not exist"):
        ktflow.load(tmp_path / "nope")


def test_no_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ktflow.load(tmp_path)


def test_unknown_model_type_lists_supported(tmp_path):
    with pytest.raises(ConfigError) as e:
        ktflow.load(write(tmp_path, dict(CONFIGS["mixtral"], model_type="llama")))
    for name in REGISTRY:
        assert name in str(e.value)


def test_missing_required_field_is_named(tmp_path):
    cfg = dict(CONFIGS["deepseek_v3"])
    del cfg["kv_lora_rank"]
    with pytest.raises(ConfigError, match="missing required field 'kv_lora_rank'"):
        ktflow.load(write(tmp_path, cfg))


def test_wrong_field_type_is_named(tmp_path):
    with pytest.raises(ConfigError, match="hidden_size"):
        ktflow.load(write(tmp_path, dict(CONFIGS["mixtral"], hidden_size="big")))


def test_both_rope_styles_resolve_identically():
    classic = dict(CONFIGS["deepseek_v3"])
    new = {k: v for k, v in classic.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, **{
        k: v for k, v in classic["rope_scaling"].items() if k != "type"}}
    fam = family("deepseek_v3")
    a, b = fam.config(classic, "a"), fam.config(new, "b")
    assert resolve_rope(a, 8, "interleaved") == resolve_rope(b, 8, "interleaved")
    assert resolve_rope(a, 8).kind == "yarn"


def test_yarn_attention_factor_from_mscales():
    cfg = family("deepseek_v3").config(dict(CONFIGS["deepseek_v3"], rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 0.5}), "x")
    import math
    r = resolve_rope(cfg, 64)
    assert r.attention_factor == pytest.approx((0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1))


def test_unsupported_rope_type(tmp_path):
    with pytest.raises(ConfigError, match="rope type 'longrope'"):
        ktflow.load(write(tmp_path, dict(CONFIGS["mixtral"], rope_scaling={"type": "longrope"})))


def test_qwen3_expert_count_from_either_key():
    fam = family("qwen3_moe")
    base = dict(CONFIGS["qwen3_moe"])
    n = base.pop("num_experts")
    assert fam.config(dict(base, num_local_experts=n), "x").num_experts == n
    assert fam.config(dict(base, num_experts=n), "x").num_experts == n


def test_kimi_k2_uses_the_deepseek_v3_spec():
    assert family("kimi_k2") is family("deepseek_v3")


def test_mixtral_default_theta_is_1e6():
    cfg = dict(CONFIGS["mixtral"])
    del cfg["rope_theta"]
    assert resolve_rope(family("mixtral").config(cfg, "x"), 8).theta == 1e6


@pytest.mark.parametrize("edit,words", [
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be >= 1, got 0"),
    ({"num_hidden_layers": -2}, "'num_hidden_layers' must be >= 1, got -2"),
    ({"hidden_size": True}, "'hidden_size' must be an integer, got True"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 8 experts"),
    ({"num_key_value_heads": 3}, "is not a multiple of num_key_value_heads 3"),
    ({"num_experts": -1}, "'num_experts' must be >= 1, got -1"),
    ({"num_experts": 1 << 40}, "past any real model"),
    ({"num_experts": 60000}, "'num_experts' is 60000, past any real model (at most 4096)"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers [5] are not layer indices 0..1"),
    ({"head_dim": None, "hidden_size": 1}, "hidden_size 1 over num_attention_heads 4 leaves a head dimension of 0"),
    ({"num_hidden_layers": "2"}, "'num_hidden_layers' must be an integer, got '2'"),
    ({"rms_norm_eps": -1e-6}, "'rms_norm_eps' must be a finite number > 0, got -1e-06"),
    ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' must be a finite number > 0, got nan"),
    ({"rope_theta": 0}, "'rope_theta' must be a finite number > 0, got 0"),
    ({"rope_theta": float("inf")}, "'rope_theta' must be a finite number > 0, got inf"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "'rope_scaling.factor' must be a finite number > 0"),
    ({"eos_token_id": -1}, "eos_token_id -1 is not a token id in 0..63"),
    ({"eos_token_id": [2, 1 << 70]}, f"eos_token_id {1 << 70} is not a token id in 0..63"),
])
def test_configs_are_checked_semantically(tmp_path, edit, words):
    """A config that parses but cannot describe a model is refused, naming the field, the value
    and the rule."""
    cfg = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
           "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="config.json.*" + re.escape(words)):
        ktflow.load(tmp_path)


def test_a_directory_where_a_weights_file_belongs_is_bad_input(tmp_path):
    from ktflow.errors import WeightError

    cfg = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
           "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(WeightError, match="is not a regular file") as e:
        ktflow.load(tmp_path).weights.names()
    assert e.value.exit_code == 2


def test_inspect_on_a_fifo_is_refused_not_a_hang(tmp_path):
    import os

    from ktflow.errors import PlanError
    from ktflow.plan.artifact import PlanFile

    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    with pytest.raises(PlanError, match="not a regular file"):
        PlanFile.load(fifo)


def test_an_unknown_topk_method_is_refused(tmp_path):
    cfg = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 64, "moe_intermediate_size": 16,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": None,
           "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "topk_method": "mystery",
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="topk_method 'mystery' is not supported for deepseek_v3"):
        ktflow.load(tmp_path)
