"""Tiny configs per family, built through transformers so the saved config.json is what
`save_pretrained` writes, and the quantization_config blocks real checkpoints carry. Dims are ones
the model files run (load_spec refuses the rest): FP8 experts 128 rows wide, MXFP4 widths of 32."""

from __future__ import annotations

import json
from pathlib import Path

_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4)

TINY = {
    "deepseek_v3": dict(_COMMON, **_MLA, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=128,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                        first_k_dense_replace=2),
    "deepseek_v32": dict(_COMMON, **_MLA, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=128,
                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                         first_k_dense_replace=1, index_n_heads=2, index_head_dim=16, index_topk=4),
    "deepseek_v4": dict(_COMMON, num_hidden_layers=6, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, head_dim=32, q_lora_rank=24, o_groups=2, o_lora_rank=128, index_n_heads=2,
                        index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3,
                        compress_ratios=[0, 4, 128, 4, 128, 0], num_hash_layers=2),
    "gpt_oss": dict(_COMMON, num_hidden_layers=4, intermediate_size=32, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "kimi_linear": dict(_COMMON, num_hidden_layers=5, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
                        num_experts=8, num_experts_per_token=2, num_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
                        linear_attn_config={"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4], "num_heads": 2,
                                            "head_dim": 16, "short_conv_kernel_size": 4}),
    "glm4_moe": dict(_COMMON, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
                     head_dim=24, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=2, topk_group=1,
                     first_k_dense_replace=1, use_qk_norm=True, attention_bias=True),
    "qwen3_5_moe": dict(
        text_config=dict(_COMMON, model_type="qwen3_5_moe_text", num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         attention_bias=True),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, out_hidden_size=64,
                           num_position_embeddings=36),
    ),
    "kimi_k25": dict(
        text_config=dict(_COMMON, **_MLA, model_type="kimi_k2", num_hidden_layers=3, intermediate_size=96,
                         moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         n_group=1, topk_group=1, first_k_dense_replace=1),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, patch_size=4,
                           pos_emb_height=8, pos_emb_width=8, pos_emb_time=2, merge_kernel_size=[2, 2]),
        projection_hidden_size=32,
        tie_word_embeddings=False,
    ),
}

# quantization_config blocks as the released checkpoints write them
QUANT = {
    "fp8": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    "fp8_ue8m0": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                  "weight_block_size": [128, 128]},
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"]},
    "ct_mxfp4": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                 "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                               "weights": {"num_bits": 4, "group_size": 32, "type": "float"}}},
                 "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                            "re:.*lm_head.*"]},
    "ct_int4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"format": "pack-quantized", "targets": ["Linear"],
                                              "weights": {"num_bits": 4, "group_size": 32, "type": "int",
                                                          "symmetric": True, "strategy": "group"}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj"]},
}


def tiny_k3_config() -> dict:
    """A tiny Kimi K3: kimi_k3 wrapper, kimi_linear text tower with every K3 extension switched on."""
    return {
        "model_type": "kimi_k3",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "kimi_linear", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
            "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "mla_use_nope": True, "mla_use_output_gate": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 32,
            "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
            "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
            "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "attn_res_block_size": 2,
            "linear_attn_config": {"full_attn_layers": [4, 5], "kda_layers": [1, 2, 3], "num_heads": 2, "head_dim": 16,
                                   "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
            "quantization_config": QUANT["ct_mxfp4"],
        },
        "vision_config": {"patch_size": 14, "vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_attention_heads": 2,
                          "vt_num_hidden_layers": 2, "qkv_hidden_size": 48, "mm_hidden_size": 32, "text_hidden_size": 64,
                          "merge_kernel_size": [2, 2], "norm_type": "rmsnorm", "pos_emb_type": "divided_fixed",
                          "linear_bias": False},
    }


def make_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kwargs = {**TINY[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def save_config(cfg, folder: Path, quantization_config: dict | None = None, **extra) -> Path:
    """save_pretrained, then add fields to config.json the way released checkpoints carry them."""
    cfg.save_pretrained(folder)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    if quantization_config is not None:
        data["quantization_config"] = quantization_config
    data.update(extra)
    path.write_text(json.dumps(data, indent=2))
    return folder
