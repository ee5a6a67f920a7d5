"""GLM-4.x MoE (`glm4_moe`) against transformers on seeded random tiny configs (tests/models/
glm4_moe_checkpoints.py: partial rotary 1/4, 1/2 or all, QK norm and q/k/v biases on or off, one to four
expert groups, dense first layers or none), in the release layout and transformers' in-memory one:
`dayzero verify` (every decode step's float32 logits within 1e-4 of transformers' full forward), the
offline LLM API and the server (each step's logprobs), a second turn from the prefix cache."""

import pytest
import torch

from dayzero.verify import load_reference, verify_checkpoint
from dayzero.weights import Checkpoint
from tests.models.engine_checks import assert_llm_matches_transformers, assert_server_matches_transformers
from tests.models.glm4_moe_checkpoints import build_glm4_moe_checkpoint, random_dims
from tests.models.helpers import assert_bf16_close_and_planned, assert_refused


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_glm4_moe_checkpoint(tmp_path_factory.mktemp("glm4_moe"), seed=0)


def test_the_layouts_hold_what_glm_ships_and_transformers_keeps(checkpoint, tmp_path):
    dims = random_dims(0)
    tensors = Checkpoint.open(checkpoint).tensors
    layer = "model.layers.1."  # first_k_dense_replace 1: layer 0 dense, layer 1 MoE
    assert tensors[layer + "mlp.experts.7.gate_proj.weight"].torch_shape == (32, dims["hidden_size"])
    assert tensors[layer + "mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert tensors[layer + "self_attn.q_norm.weight"].torch_shape == (dims["head_dim"],)
    assert "model.layers.0.mlp.gate_proj.weight" in tensors and "model.layers.3.eh_proj.weight" in tensors  # MTP
    fused = Checkpoint.open(build_glm4_moe_checkpoint(tmp_path, seed=0, layout="in-memory")).tensors
    assert fused[layer + "mlp.experts.gate_up_proj"].torch_shape == (8, 64, dims["hidden_size"])


@pytest.mark.parametrize("seed, layout", [(2, "in-memory")])  # the release layout: seed 5 in tests/test_verify.py
def test_verify_passes_on_random_configs(seed, layout, tmp_path):
    result = verify_checkpoint(build_glm4_moe_checkpoint(tmp_path, seed=seed, layout=layout), prompt_len=40,
                               decode_steps=6)
    assert result.passed and result.reference_consistent, result.first_divergence
    assert result.max_rel_err <= 1e-4


def test_llm_api_and_server_give_transformers_step_logits(checkpoint):
    hf = load_reference(checkpoint, torch.float32, "cpu")
    assert_llm_matches_transformers(checkpoint, [5, 23, 40], hf)
    assert_server_matches_transformers(checkpoint, [9, 33], hf)


def test_bfloat16_runs_close_to_float32_and_holds_the_planned_bytes(checkpoint):
    assert_bf16_close_and_planned(checkpoint, 24, 256)


@pytest.mark.parametrize("changes, field", [
    # GLM-4.5-FP8: compressed-tensors per-channel FP8 weights with dynamic per-token FP8 activations
    (dict(quantization_config={"quant_method": "compressed-tensors", "format": "float-quantized",
                               "config_groups": {"group_0": {"format": "float-quantized", "weights": {"num_bits": 8}}}}),
     "quantization_config.format"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), "rope_scaling.rope_type"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(n_group=3), "n_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_configs_are_refused_by_inspect_and_loader(tmp_path, changes, field):
    assert_refused(tmp_path, {"model_type": "glm4_moe", **random_dims(0), **changes}, field)
