"""Unsupported configs fail with the field, the value and what is supported."""

from __future__ import annotations

import pytest

from dayzero.spec import UnsupportedModelError, load_spec

from .fullsize_configs import config
from .tiny_configs import tiny_k3_config


def _raises(cfg: dict, field: str, value) -> UnsupportedModelError:
    with pytest.raises(UnsupportedModelError) as info:
        load_spec(cfg)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == field and err.value == value
    assert f"'{field}'" in str(err) and repr(value) in str(err) and "supported:" in str(err)
    return err


def test_unknown_model_type():
    err = _raises({"model_type": "llama_moe_9000", "num_hidden_layers": 2}, "model_type", "llama_moe_9000")
    assert "deepseek_v4" in str(err) and "kimi_linear" in str(err)


def test_unknown_routing_function():
    cfg = config("deepseek-v4-flash")
    cfg["scoring_func"] = "tanh"
    err = _raises(cfg, "scoring_func", "tanh")
    assert "sqrtsoftplus" in str(err)
    cfg = config("deepseek-v3")
    cfg["scoring_func"] = "sparsemax"
    _raises(cfg, "scoring_func", "sparsemax")
    cfg = tiny_k3_config()
    cfg["text_config"]["moe_router_activation_func"] = "relu"
    _raises(cfg, "moe_router_activation_func", "relu")


def test_unknown_quant_method():
    cfg = config("gpt-oss-120b")
    cfg["quantization_config"] = {"quant_method": "gguf_q3"}
    err = _raises(cfg, "quantization_config.quant_method", "gguf_q3")
    assert "mxfp4" in str(err) and "compressed-tensors" in str(err)


def test_unknown_compressed_tensors_format():
    cfg = config("kimi-k3")
    qc = cfg["text_config"]["quantization_config"]
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    _raises(cfg, "quantization_config.format", "nvfp4-pack-quantized")


def test_unknown_expert_dtype():
    cfg = config("deepseek-v4-pro")
    cfg["expert_dtype"] = "fp2"
    _raises(cfg, "expert_dtype", "fp2")


def test_unknown_layer_type_strings():
    cfg = config("gpt-oss-120b")
    cfg["layer_types"] = ["sliding_attention", "chunked_attention"] * 18
    _raises(cfg, "layer_types", "chunked_attention")
    cfg = config("deepseek-v4-flash")
    cfg["compress_ratios"] = [0, 0, 16] + [4] * 41
    _raises(cfg, "compress_ratios", 16)
    cfg = config("deepseek-v4-flash")
    cfg["layer_types"] = ["sliding_attention"] * 42 + ["linear_attention"]
    _raises(cfg, "layer_types", "linear_attention")


def test_unknown_activation_and_kimi_text_type():
    cfg = tiny_k3_config()
    cfg["text_config"]["hidden_act"] = "gelu"
    _raises(cfg, "hidden_act", "gelu")
    cfg = tiny_k3_config()
    cfg["text_config"]["model_type"] = "qwen3_next"
    _raises(cfg, "text_config.model_type", "qwen3_next")


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_spec(tmp_path)
