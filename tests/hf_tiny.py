"""Tiny random-weight HF transformers models of the six families, saved with save_pretrained.

Router weights are scaled up so the top-k choice of each token is decisive (no near ties that
float rounding could flip), and DeepSeek-V3's score-correction bias is made non-zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256,
              initializer_range=0.1,
              rms_norm_eps=1e-6, tie_word_embeddings=False)

MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}

#: name -> (transformers config class name, config kwargs)
CASES: dict[str, tuple[str, dict]] = {
    "deepseek_v3": ("DeepseekV3Config", dict(
        COMMON, **MLA, q_lora_rank=24, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
    "deepseek_v3_plain_q_yarn": ("DeepseekV3Config", dict(
        COMMON, **MLA, q_lora_rank=None, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
        norm_topk_prob=False, routed_scaling_factor=1.5, rope_parameters=YARN, rope_interleave=False)),
    "deepseek_v2_lite": ("DeepseekV2Config", dict(
        COMMON, **MLA, q_lora_rank=None, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
        routed_scaling_factor=1.0)),
    "deepseek_v2_grouped_yarn": ("DeepseekV2Config", dict(
        COMMON, **MLA, q_lora_rank=24, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=0, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=16.0, rope_parameters=YARN)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        COMMON, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        COMMON, num_key_value_heads=2, head_dim=24, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        COMMON, num_key_value_heads=2, head_dim=24, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True, partial_rotary_factor=0.5)),
    "glm4_moe_air": ("Glm4MoeConfig", dict(
        COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=False,
        routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False)),
    "mixtral": ("MixtralConfig", dict(
        COMMON, num_key_value_heads=2, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)),
    "mixtral_sliding": ("MixtralConfig", dict(
        COMMON, num_key_value_heads=2, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
        sliding_window=7)),
}


def _sharpen_routers(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and "shared" not in name and p.dim() == 2 and p.shape[0] > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def make(case: str, directory: Path, seed: int = 0):
    """Build, save (float32) and return the HF model of `case`."""
    import transformers

    cls_name, kwargs = CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _sharpen_routers(model, torch.Generator().manual_seed(seed + 1))
    model.eval()
    model.save_pretrained(directory)
    return model


def to_classic_rope(directory: Path) -> None:
    """Rewrite a saved config.json from `rope_parameters` to the classic rope_theta + rope_scaling."""
    p = directory / "config.json"
    cfg = json.loads(p.read_text())
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    kind = rp.pop("rope_type", "default")
    if "partial_rotary_factor" in rp:  # a top-level key in the classic style
        cfg["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rp}
    p.write_text(json.dumps(cfg, indent=1))


def to_fp8(model: torch.nn.Module, directory: Path, block: tuple[int, int] = (128, 128)) -> dict:
    """Save `model` in the published FP8 layout: each linear weight as F8_E4M3 per block of
    `block` (amax / 448 scales) with `<name>_scale_inv` beside it, routed experts one tensor per
    expert and projection (`experts.<e>.gate_proj.weight`, as the releases store them, where
    transformers holds them fused), config.json with quantization_config. Returns the dequantized
    float32 state dict (what an FP8 checkpoint means, in transformers' names), for the reference
    model."""
    from safetensors.torch import save_file

    from ktflow.frontend.quant import config_entry, dequantize, quantize, stored_fp8

    directory.mkdir(parents=True, exist_ok=True)
    tensors, meant = {}, {}
    for name, t in model.state_dict().items():
        t = t.detach().float().contiguous()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and t.dim() == 3:
            prefix, fused = name.rsplit(".", 1)
            inter = t.shape[1] // 2
            parts = {"gate_proj": (slice(0, inter),), "up_proj": (slice(inter, None),)} \
                if fused == "gate_up_proj" else {"down_proj": (slice(None),)}
            back = torch.empty_like(t)
            for e in range(t.shape[0]):
                for proj, (rows,) in parts.items():
                    w8, scale = quantize(t[e, rows], block)
                    key = f"{prefix}.{e}.{proj}.weight"
                    tensors[key], tensors[key + "_scale_inv"] = w8, scale
                    back[e, rows] = dequantize(w8, scale, block)
            meant[name] = back
            continue
        if not stored_fp8(name, tuple(t.shape)):
            tensors[name] = meant[name] = t
            continue
        w8, scale = quantize(t, block)
        tensors[name], tensors[name + "_scale_inv"] = w8, scale
        meant[name] = dequantize(w8, scale, block)
    save_file(tensors, str(directory / "model.safetensors"))
    cfg = json.loads(model.config.to_json_string())
    cfg["quantization_config"] = config_entry(block)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return meant
