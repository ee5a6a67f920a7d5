"""Published full-size configs, written from the model cards and config.json files (trimmed to the
fields the spec reads), with the published parameter counts to check plans against.

Sources: huggingface.co/{deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct, deepseek-ai/DeepSeek-V3.2,
deepseek-ai/DeepSeek-V4-Pro, deepseek-ai/DeepSeek-V4-Flash, openai/gpt-oss-120b, moonshotai/Kimi-K3, zai-org/GLM-4.5,
Qwen/Qwen3.5-35B-A3B, Qwen/Qwen3.5-397B-A17B}/config.json
and their model cards (see /work/shared/research/*.md).
"""

from __future__ import annotations

import copy

_FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "quantization_config": dict(_FP8_BLOCK),
}

KIMI_K2 = {
    **copy.deepcopy(DEEPSEEK_V3),
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "routed_scaling_factor": 2.827,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 0,
}

DEEPSEEK_V32 = {
    **copy.deepcopy(DEEPSEEK_V3),
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "quantization_config": {**_FP8_BLOCK, "scale_fmt": "ue8m0"},
}


def _v4_ratios(n_layers: int, first: list[int]) -> list[int]:
    """compress_ratios as published: the given first entries, then CSA(4)/HCA(128) alternating,
    then 0 for the MTP layer (transformers keeps only the first num_hidden_layers)."""
    rest = [4 if i % 2 == 0 else 128 for i in range(n_layers - len(first))]
    return first + rest + [0]


DEEPSEEK_V4_PRO = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "o_groups": 16,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 1024,
    "sliding_window": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_hash_layers": 3,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "moe_intermediate_size": 3072,
    "num_experts_per_tok": 6,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "compress_ratios": _v4_ratios(61, [128, 128]),
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "expert_dtype": "fp4",
    "quantization_config": {**_FP8_BLOCK, "scale_fmt": "ue8m0"},
}

DEEPSEEK_V4_FLASH = {
    **copy.deepcopy(DEEPSEEK_V4_PRO),
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "index_topk": 512,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5,
    "compress_ratios": _v4_ratios(43, [0, 0]),
}

GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    },
}

_K3_FULL_ATTN = list(range(4, 93, 4)) + [93]  # 1-based, 24 MLA layers

KIMI_K3 = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 33792,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "full_attn_layers": _K3_FULL_ATTN,
            "kda_layers": [i for i in range(1, 94) if i not in _K3_FULL_ATTN],
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": {"num_bits": 4, "group_size": 32, "type": "float",
                                                      "strategy": "group", "symmetric": True,
                                                      "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        },
    },
    "vision_config": {
        "patch_size": 14,
        "vt_hidden_size": 1024,
        "vt_intermediate_size": 4096,
        "vt_num_attention_heads": 12,
        "vt_num_hidden_layers": 27,
        "qkv_hidden_size": 1536,
        "mm_hidden_size": 1024,
        "text_hidden_size": 7168,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2",
        "norm_type": "rmsnorm",
        "pos_emb_type": "divided_fixed",
        "attn_bias": False,
        "linear_bias": False,
    },
}

# zai-org/GLM-4.5 (GLM-4.6 and 4.7 share its shape; 4.6 has a 200K context)
GLM_45 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "partial_rotary_factor": 0.5,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "vocab_size": 151552,
}

# Qwen/Qwen3.5-35B-A3B and Qwen/Qwen3.5-397B-A17B (the text and vision fields the spec reads)
_QWEN3_5_VISION = {"model_type": "qwen3_5_moe_vision", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                   "num_heads": 16, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                   "num_position_embeddings": 2304, "out_hidden_size": 2048, "in_channels": 3,
                   "hidden_act": "gelu_pytorch_tanh"}
QWEN3_5_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "full_attention_interval": 4, "max_position_embeddings": 262144,
        "attn_output_gate": True, "mtp_num_hidden_layers": 1, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    },
    "vision_config": _QWEN3_5_VISION,
}
QWEN3_5_397B = {
    **QWEN3_5_35B,
    "text_config": {**QWEN3_5_35B["text_config"], "hidden_size": 4096, "num_hidden_layers": 60, "num_attention_heads": 32,
                    "linear_num_value_heads": 64, "num_experts": 512, "num_experts_per_tok": 10,
                    "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024},
    "vision_config": {**_QWEN3_5_VISION, "out_hidden_size": 4096},
}

# name -> (config, published total params, published active params)
PUBLISHED = {
    "deepseek-v3": (DEEPSEEK_V3, 671e9, 37e9),
    "kimi-k2": (KIMI_K2, 1.04e12, 32.6e9),
    "deepseek-v3.2": (DEEPSEEK_V32, 671e9, 37e9),
    "deepseek-v4-pro": (DEEPSEEK_V4_PRO, 1.6e12, 49e9),
    "deepseek-v4-flash": (DEEPSEEK_V4_FLASH, 284e9, 13e9),
    "gpt-oss-120b": (GPT_OSS_120B, 116.83e9, 5.13e9),
    "kimi-k3": (KIMI_K3, 2.78e12, 104e9),
    "glm-4.5": (GLM_45, 355e9, 32e9),
    "qwen3.5-35b-a3b": (QWEN3_5_35B, 35e9, 3e9),
    "qwen3.5-397b-a17b": (QWEN3_5_397B, 397e9, 17e9),
}


def config(name: str) -> dict:
    """A deep copy of a published config, safe to modify."""
    return copy.deepcopy(PUBLISHED[name][0])
