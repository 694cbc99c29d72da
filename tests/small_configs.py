"""Small config.json dicts of each family (no transformers needed), for golden and unit tests."""

BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
            rms_norm_eps=1e-6, torch_dtype="bfloat16", rope_theta=10000.0)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4,
           intermediate_size=48, moe_intermediate_size=16)

CONFIGS = {
    "deepseek_v3": dict(BASE, **MLA, model_type="deepseek_v3", q_lora_rank=24, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        n_shared_experts=1, routed_scaling_factor=2.5,
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                      "mscale": 1.0, "mscale_all_dim": 1.0}),
    "deepseek_v2": dict(BASE, **MLA, model_type="deepseek_v2", n_routed_experts=8, num_experts_per_tok=2,
                        topk_method="group_limited_greedy", n_group=2, topk_group=1, n_shared_experts=2,
                        first_k_dense_replace=1, routed_scaling_factor=16.0),
    "qwen2_moe": dict(BASE, model_type="qwen2_moe", num_key_value_heads=2, intermediate_size=48,
                      moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                      num_experts_per_tok=2),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_key_value_heads=2, head_dim=16, intermediate_size=48,
                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "glm4_moe": dict(BASE, model_type="glm4_moe", num_key_value_heads=2, head_dim=16, intermediate_size=48,
                     moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                     partial_rotary_factor=0.5),
    "mixtral": dict(BASE, model_type="mixtral", num_key_value_heads=2, intermediate_size=48, num_local_experts=4,
                    num_experts_per_tok=2),
}


def graph_of(name: str, act=None):
    from ktflow.models import family

    fam = family(CONFIGS[name]["model_type"])
    cfg = fam.config(CONFIGS[name], name)
    return fam.build(cfg, act or cfg.weight_dtype)
