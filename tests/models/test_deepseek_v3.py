"""DeepSeek-V3 and Kimi-K2 against transformers on tiny random checkpoints in the real FP8 layout.

transformers dequantizes the FP8 block weights on load (CPU), to exactly the float32 values our
ops dequantize, so both sides run the same weights. Prompts of 5 tokens stay inside YaRN's original
context (32); 45 tokens reach past it; generation runs 32 tokens further.
"""

import json

import pytest
import torch

from dayzero.formats.fp8 import dequantize_weight_blocks
from dayzero.models import load_model
from tests.models.deepseek_checkpoints import V3_DIMS, build_deepseek_v3_checkpoint, load_reference, positions, prompt, rel_err
from tests.models.helpers import assert_greedy_matches_transformers, assert_logits_match_transformers, assert_refused

VOCAB = V3_DIMS["vocab_size"]
MODEL_TYPES = ("deepseek_v3", "kimi_k2")



@pytest.fixture(autouse=True)
def _private_rng():
    """Deterministic draws here, and the global generator left as other test files expect it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield

@pytest.fixture(scope="module", params=MODEL_TYPES)
def checkpoint(request, tmp_path_factory):
    return build_deepseek_v3_checkpoint(tmp_path_factory.mktemp(request.param), model_type=request.param)


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_model(checkpoint, dtype=torch.float32, progress=False), load_reference(checkpoint)


def test_checkpoint_has_the_real_layout(checkpoint):
    from dayzero.weights import Checkpoint

    tensors = Checkpoint.open(checkpoint).tensors
    layer = "model.layers.1."
    expert = tensors[layer + "mlp.experts.3.gate_proj.weight"]
    assert (expert.dtype, expert.torch_shape) == ("F8_E4M3", (V3_DIMS["moe_intermediate_size"], V3_DIMS["hidden_size"]))
    assert tensors[layer + "mlp.experts.3.down_proj.weight_scale_inv"].dtype == "F32"
    assert tensors[layer + "mlp.shared_experts.up_proj.weight"].dtype == "F8_E4M3"
    assert tensors[layer + "self_attn.kv_b_proj.weight_scale_inv"].torch_shape == (2, 1)
    assert tensors[layer + "mlp.gate.weight"].dtype == "BF16"
    assert tensors[layer + "mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert tensors["lm_head.weight"].dtype == "BF16" and tensors["model.embed_tokens.weight"].dtype == "BF16"
    assert "model.layers.3.eh_proj.weight" in tensors  # the MTP layer, which the model skips
    assert not any("gate_up_proj" in name for name in tensors)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and "rope_scaling" in config


def test_experts_hold_the_weights_transformers_dequantizes(models):
    ours, hf = models
    for layer_ours, layer_hf in zip(ours.model.layers[1:], hf.model.layers[1:]):
        e = layer_ours.mlp.experts
        w13 = dequantize_weight_blocks(e.w13, e.w13_scale, dtype=torch.float32)
        w2 = dequantize_weight_blocks(e.w2, e.w2_scale, dtype=torch.float32)
        assert torch.equal(w13, layer_hf.mlp.experts.gate_up_proj.detach())
        assert torch.equal(w2, layer_hf.mlp.experts.down_proj.detach())


@pytest.mark.parametrize("length", (5, 45))
def test_logits_match_transformers(models, length):
    ours, hf = models
    assert_logits_match_transformers(ours, hf, prompt(2, length), VOCAB)


@pytest.mark.parametrize("length", (5, 40))
def test_greedy_generation_matches_transformers(models, length):
    ours, hf = models
    assert_greedy_matches_transformers(ours, hf, prompt(1, length, seed=1))


def test_batched_decode_matches_full_forward(models):
    ours, _ = models
    ids = prompt(3, 12, seed=2)
    cache = ours.new_cache(3)
    with torch.no_grad():
        first = ours(ids[:, :7], positions(ids[:, :7]), cache)
        rest = ours(ids[:, 7:], positions(ids[:, 7:], 7), cache)
        full = ours(ids, positions(ids))
    assert cache.length == 12
    assert rel_err(torch.cat([first, rest], dim=1), full) <= 1e-5


@pytest.mark.parametrize("options", [dict(q_lora_rank=None), dict(attention_bias=True), dict(fp8=False)],
                         ids=["plain_q_proj", "attention_bias", "bf16_weights"])
def test_variants_match_transformers(tmp_path, options):
    path = build_deepseek_v3_checkpoint(tmp_path, mtp=False, **options)
    ours, hf = load_model(path, dtype=torch.float32, progress=False), load_reference(path)
    ids = prompt(2, 12, seed=3)
    with torch.no_grad():
        assert rel_err(ours(ids, positions(ids)), hf(ids).logits) <= 1e-4


def test_bfloat16_runs_close_to_float32(checkpoint, models):
    """bf16 differs from float32 by rounding, and now and then by a routing decision that flips (as
    transformers' own bf16 does): most positions stay within bf16 rounding of float32."""
    ours32, _ = models
    ours16 = load_model(checkpoint, dtype=torch.bfloat16, progress=False)
    ids = prompt(2, 20, seed=4)
    with torch.no_grad():
        got = ours16(ids, positions(ids))
        want = ours32(ids, positions(ids))
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    per_position = (got - want).abs().amax(-1) / want.abs().amax(-1)
    assert float(per_position.median()) <= 3e-2
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8


def _config(**changes):
    config = {"model_type": "deepseek_v3", **V3_DIMS, "rope_scaling": None, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, field", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(moe_intermediate_size=96), "moe_intermediate_size"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.type"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]}), "quantization_config.weight_block_size"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_config_is_refused_by_inspect_and_loader(tmp_path, changes, field):
    assert_refused(tmp_path, _config(**changes), field)
