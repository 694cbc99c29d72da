"""`ktflow demo`: a small DeepSeek-V3-shaped random-weight checkpoint, compiled and run.

The checkpoint (MLA with q LoRA, yarn rope, 1 dense + 3 MoE layers of 32 routed experts with
grouped top-4 routing and a shared expert, bf16) is written once into the cache dir
($KTFLOW_CACHE, else $XDG_CACHE_HOME/ktflow, else ~/.cache/ktflow) and reused after that.
"""

from __future__ import annotations

import json
import os
from ..util import env
from pathlib import Path

DEMO_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 32,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def cache_dir() -> Path:
    if env.get("KTFLOW_CACHE"):
        return Path(env.get("KTFLOW_CACHE"))
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ktflow"


def ensure_demo_checkpoint(directory: Path | None = None) -> tuple[Path, bool]:
    """The demo checkpoint dir, written if absent or stale; returns (dir, written_now)."""
    from ..frontend.checkpoint import write_random_checkpoint
    from ..frontend.load import load, read_config

    d = directory or cache_dir() / "demo-deepseek-v3"
    if (d / "config.json").exists() and (d / "model.safetensors").exists():
        try:
            if read_config(d)[1] == DEMO_CONFIG:
                load(d)
                return d, False
        except Exception:
            pass  # stale or damaged: write it again
    from ..models import family

    fam = family(DEMO_CONFIG["model_type"])
    cfg = fam.config(DEMO_CONFIG, "demo config")
    write_random_checkpoint(d, json.loads(json.dumps(DEMO_CONFIG)), fam.build(cfg, cfg.weight_dtype), seed=0)
    return d, True
