"""ModelSpec from tiny transformers configs: per-layer kinds match transformers' own derivation,
parameter totals match the instantiated transformers model exactly."""

from __future__ import annotations

import pytest
import torch

from dayzero.plan import active_params, total_params
from dayzero.spec import UnsupportedModelError, load_spec

from .tiny_configs import QUANT, make_config, save_config, tiny_k3_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V4_KIND = {"sliding_attention": "swa", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _causal_lm_params(cfg) -> int:
    torch.manual_seed(0)
    return _n_params(transformers.AutoModelForCausalLM.from_config(cfg))


def test_deepseek_v3_fp8(tmp_path):
    cfg = make_config("deepseek_v3")
    spec = load_spec(save_config(cfg, tmp_path, QUANT["fp8"], scoring_func="sigmoid", topk_method="noaux_tc"))
    assert [k for k, _ in spec.layer_kinds()] == ["mla"] * 4
    assert [m for _, m in spec.layer_kinds()] == ["dense", "dense", "moe", "moe"]  # first_k_dense_replace=2
    e = spec.experts
    assert (e.num, e.top_k, e.num_shared, e.intermediate_size) == (8, 2, 1, 128)
    assert (e.routing.function, e.routing.correction_bias, e.routing.n_group, e.routing.topk_group) == ("sigmoid", True, 2, 1)
    assert (spec.quant.expert_format, spec.quant.dense_format, spec.quant.fp8_block, spec.quant.scale_fmt) == (
        "fp8", "fp8", (128, 128), "float")
    assert spec.layers[0].attention.kv_lora_rank == 16 and spec.layers[0].attention.q_lora_rank == 24
    assert total_params(spec) == _causal_lm_params(cfg)


def test_kimi_k2_model_type_is_deepseek_v3(tmp_path):
    cfg = make_config("deepseek_v3")
    spec = load_spec(save_config(cfg, tmp_path, QUANT["fp8"], model_type="kimi_k2"))
    assert spec.model_type == "kimi_k2" and spec.text_model_type == "deepseek_v3"
    assert total_params(spec) == _causal_lm_params(cfg)


def test_deepseek_v32_dsa(tmp_path):
    cfg = make_config("deepseek_v32")
    spec = load_spec(save_config(cfg, tmp_path, QUANT["fp8_ue8m0"]))
    assert [k for k, _ in spec.layer_kinds()] == ["dsa"] * 3
    assert [m for _, m in spec.layer_kinds()] == ["dense" if t == "dense" else "moe" for t in cfg.mlp_layer_types]
    a = spec.layers[0].attention
    assert (a.index_n_heads, a.index_head_dim, a.index_topk) == (2, 16, 4)
    assert spec.quant.scale_fmt == "ue8m0"
    assert total_params(spec) == _causal_lm_params(cfg)


def test_deepseek_v4_pattern_and_fp4_experts(tmp_path):
    cfg = make_config("deepseek_v4")
    spec = load_spec(save_config(cfg, tmp_path, QUANT["fp8_ue8m0"], expert_dtype="fp4"))
    assert [k for k, _ in spec.layer_kinds()] == [V4_KIND[t] for t in cfg.layer_types]
    assert [k for k, _ in spec.layer_kinds()] == ["swa", "csa", "hca", "csa", "hca", "swa"]
    assert [m for _, m in spec.layer_kinds()] == list(cfg.mlp_layer_types) == ["hash_moe"] * 2 + ["moe"] * 4
    assert [layer.attention.compress_ratio for layer in spec.layers] == [None, 4, 128, 4, 128, None]
    assert spec.experts.routing.function == "sqrtsoftplus"
    assert spec.quant.expert_format == "mxfp4" and spec.quant.dense_format == "fp8"
    assert spec.cross_layer.kind == "hyper_connection" and spec.cross_layer.hc_mult == 2
    assert spec.layers[0].attention.sinks and spec.layers[0].attention.sliding_window == 8
    assert total_params(spec) == _causal_lm_params(cfg)


@pytest.mark.parametrize("n_layers", [1, 2, 5, 8])
def test_deepseek_v4_default_layer_types_match_transformers(n_layers):
    kwargs = dict(make_config("deepseek_v4").to_diff_dict())
    for key in ("layer_types", "mlp_layer_types", "compress_ratios", "num_hash_layers"):
        kwargs.pop(key, None)
    kwargs["num_hidden_layers"] = n_layers
    cfg = transformers.AutoConfig.for_model(**kwargs)
    raw = {k: v for k, v in kwargs.items() if k != "transformers_version"}
    spec = load_spec(raw)
    assert [k for k, _ in spec.layer_kinds()] == [V4_KIND[t] for t in cfg.layer_types]
    assert [m for _, m in spec.layer_kinds()] == list(cfg.mlp_layer_types)


def test_deepseek_v4_expert_dtype_inside_quantization_config():
    raw = {k: v for k, v in make_config("deepseek_v4").to_diff_dict().items() if k != "transformers_version"}
    raw["quantization_config"] = {**QUANT["fp8_ue8m0"], "expert_dtype": "fp4"}
    assert load_spec(raw).quant.expert_format == "mxfp4"
    raw["quantization_config"] = QUANT["fp8_ue8m0"]
    raw["moe_intermediate_size"] = 128  # FP8 experts: 128-row blocks
    assert load_spec(raw).quant.expert_format == "fp8"


def test_gpt_oss_mxfp4(tmp_path):
    cfg = make_config("gpt_oss")
    spec = load_spec(save_config(cfg, tmp_path, QUANT["mxfp4"]))
    assert [k for k, _ in spec.layer_kinds()] == ["swa" if t == "sliding_attention" else "gqa" for t in cfg.layer_types]
    assert [k for k, _ in spec.layer_kinds()] == ["swa", "gqa", "swa", "gqa"]
    assert all(m == "moe" for _, m in spec.layer_kinds())
    r = spec.experts.routing
    assert (r.function, r.softmax_after_topk, spec.experts.top_k) == ("softmax", True, 2)
    assert spec.quant.expert_format == "mxfp4" and spec.quant.dense_format == "bf16"
    assert spec.layers[0].attention.sinks and spec.layers[0].mlp.activation.kind == "swiglu_clamped"
    assert total_params(spec) == _causal_lm_params(cfg)


def test_kimi_linear_plain(tmp_path):
    cfg = make_config("kimi_linear")
    spec = load_spec(save_config(cfg, tmp_path))
    assert [k for k, _ in spec.layer_kinds()] == ["mla" if t == "full_attention" else "kda" for t in cfg.layer_types]
    assert [k for k, _ in spec.layer_kinds()] == ["kda", "mla", "kda", "kda", "mla"]
    assert [m for _, m in spec.layer_kinds()] == ["dense", "moe", "moe", "moe", "moe"]
    kda = spec.layers[0].attention
    assert (kda.num_heads, kda.head_dim, kda.conv_kernel, kda.output_gate, kda.gate_lower_bound) == (2, 16, 4, "low_rank", None)
    assert spec.experts.latent_dim is None and spec.cross_layer.kind == "none"
    assert spec.layers[0].mlp.activation.kind == "swiglu" and spec.experts.routing.function == "sigmoid"
    assert spec.quant.expert_format == "bf16"
    assert total_params(spec) == _causal_lm_params(cfg)


def test_glm4_moe(tmp_path):
    cfg = make_config("glm4_moe")
    spec = load_spec(save_config(cfg, tmp_path))
    assert spec.layer_kinds() == [("gqa", "dense"), ("gqa", "moe"), ("gqa", "moe")]
    a = spec.layers[0].attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.qk_rope_head_dim, a.qk_norm, a.qkv_bias, a.bias) == (
        4, 2, 24, 12, True, True, False)  # Glm4MoeConfig's partial_rotary_factor 0.5; biases on q, k, v only
    r = spec.experts.routing
    assert (r.function, r.correction_bias, r.n_group, r.topk_group, spec.experts.num_shared) == ("sigmoid", True, 2, 1, 1)
    assert spec.mtp_layers == 1 and spec.context.rope_theta == 10000.0
    assert total_params(spec) == _causal_lm_params(cfg)


def test_qwen3_5_moe(tmp_path):
    """The wrapper's text tower (layer kinds from full_attention_interval) and vision tower, counted as
    transformers' Qwen3_5MoeForConditionalGeneration holds them."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    cfg = make_config("qwen3_5_moe")
    spec = load_spec(save_config(cfg, tmp_path))
    assert spec.layer_kinds() == [("gdn", "moe")] * 3 + [("gqa", "moe")]
    gdn, full = spec.layers[0].attention, spec.layers[3].attention
    assert (gdn.num_heads, gdn.num_kv_heads, gdn.head_dim, gdn.v_head_dim, gdn.conv_kernel) == (4, 2, 8, 16, 4)
    assert (full.qk_rope_head_dim, full.qk_norm, full.output_gate, full.bias) == (4, True, "sigmoid", True)
    e = spec.experts
    assert (e.routing.function, e.routing.normalize, e.shared_gate, e.shared_intermediate_size) == ("softmax", True, True, 48)
    assert spec.vision.kind == "qwen3_5_vit" and spec.text_model_type == "qwen3_5_moe_text"
    torch.manual_seed(0)
    assert total_params(spec) == _n_params(Qwen3_5MoeForConditionalGeneration(cfg))
    text = load_spec({**cfg.text_config.to_dict(), "model_type": "qwen3_5_moe_text"})
    assert total_params(text) == _causal_lm_params(cfg.text_config) and text.vision is None


def test_kimi_linear_with_k3_extensions():
    spec = load_spec(tiny_k3_config())
    assert spec.model_type == "kimi_k3" and spec.text_model_type == "kimi_linear"
    assert [k for k, _ in spec.layer_kinds()] == ["kda", "kda", "kda", "mla", "mla"]
    assert [m for _, m in spec.layer_kinds()] == ["dense"] + ["moe"] * 4
    kda, mla = spec.layers[0].attention, spec.layers[3].attention
    assert (kda.output_gate, kda.gate_lower_bound) == ("full_rank", -5.0)
    assert (mla.output_gate, mla.nope, mla.q_lora_rank) == ("sigmoid", True, 24)
    e = spec.experts
    assert (e.latent_dim, e.input_dim, e.latent_norm, e.num_shared, e.shared_intermediate_size) == (32, 32, True, 2, 64)
    act = spec.layers[0].mlp.activation
    assert (act.kind, act.beta, act.linear_beta) == ("situ", 4.0, 25.0)
    assert spec.cross_layer.kind == "attention_residual" and spec.cross_layer.attn_res_block_size == 2
    assert spec.quant.expert_format == "mxfp4" and spec.quant.dense_format == "bf16"
    assert spec.vision.kind == "moonvit3d" and spec.vision.norm == "rms_norm"


def test_kimi_k25_vision(tmp_path):
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    cfg = make_config("kimi_k25")
    spec = load_spec(save_config(cfg, tmp_path, QUANT["fp8"]))
    assert spec.model_type == "kimi_k25" and spec.text_model_type == "deepseek_v3"
    assert [k for k, _ in spec.layer_kinds()] == ["mla"] * 3
    assert [m for _, m in spec.layer_kinds()] == ["dense", "moe", "moe"]
    assert spec.quant.expert_format == "fp8" and spec.quant.dense_format == "fp8"
    v = spec.vision
    assert (v.kind, v.num_layers, v.hidden_size, v.patch_size, v.merge_kernel) == ("moonvit", 2, 32, 4, (2, 2))
    torch.manual_seed(0)
    assert total_params(spec) == _n_params(Kimi_K25ForConditionalGeneration(cfg))


def test_kimi_k25_default_ties_embeddings():
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    kwargs = {k: v for k, v in make_config("kimi_k25").to_diff_dict().items()}
    cfg = make_config("kimi_k25")
    raw = cfg.to_dict()
    raw.pop("tie_word_embeddings")
    spec = load_spec(raw)
    assert spec.tie_word_embeddings
    tied = transformers.AutoConfig.for_model("kimi_k25", **{k: v for k, v in kwargs.items()
                                                           if k not in ("tie_word_embeddings", "model_type", "transformers_version")})
    assert total_params(spec) == _n_params(Kimi_K25ForConditionalGeneration(tied))


def test_active_is_less_than_total_for_moe():
    spec = load_spec(make_config("deepseek_v3").to_dict())
    assert 0 < active_params(spec) < total_params(spec)


def test_separate_quantization_config_json(tmp_path):
    import json

    cfg = make_config("gpt_oss")
    save_config(cfg, tmp_path)
    (tmp_path / "quantization_config.json").write_text(json.dumps(QUANT["mxfp4"]))
    assert load_spec(tmp_path).quant.expert_format == "mxfp4"


def test_int4_experts_are_refused(tmp_path):
    """Kimi K2.5-style int4 experts (compressed-tensors pack-quantized): no model file holds them,
    so load_spec (inspect) refuses them as the loader does."""
    with pytest.raises(UnsupportedModelError) as info:
        load_spec(save_config(make_config("kimi_k25"), tmp_path, QUANT["ct_int4"]))
    assert (info.value.field, info.value.value) == ("quantization_config.quant_method", "compressed-tensors")


def test_modelopt_hf_quant_config_is_read_and_refused(tmp_path):
    """ModelOpt's per-tensor FP8 (hf_quant_config.json) is recognised; the DeepSeek model file holds
    128x128 block scales only, so load_spec refuses it by name."""
    import json

    save_config(make_config("deepseek_v3"), tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(UnsupportedModelError) as info:
        load_spec(tmp_path)
    assert (info.value.field, info.value.value) == ("quantization_config.quant_method", "modelopt")
