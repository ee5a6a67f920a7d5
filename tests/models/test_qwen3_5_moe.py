"""Qwen3.5-MoE (`qwen3_5_moe` and its text tower `qwen3_5_moe_text`) against transformers on seeded random
tiny configs (tests/models/qwen3_5_moe_checkpoints.py: value heads grouped 1-3 over key heads, partial
rotary 1/4 or 1/2, 2 or 4 conv taps, top-1 to top-4 of 4 or 8 experts, linear and full attention layers in
random order), in the release layout (stacked experts) and what transformers' save_pretrained writes (one
tensor per expert): `dayzero verify` past the 64-token chunk (every decode step's float32 logits within
1e-4 of transformers' full forward), the LLM API with chunked prefill (a step's decodes and prompt chunks
together) and the server, a second turn resuming the Gated DeltaNet states from a snapshot."""

import pytest
import torch

from dayzero.spec import load_spec
from dayzero.verify import load_reference, verify_checkpoint
from dayzero.weights import Checkpoint
from tests.models.engine_checks import assert_llm_matches_transformers, assert_server_matches_transformers
from tests.models.helpers import assert_bf16_close_and_planned, assert_refused
from tests.models.qwen3_5_moe_checkpoints import build_qwen3_5_moe_checkpoint, random_dims


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_qwen3_5_moe_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), seed=1, layout="transformers")


def test_the_layouts_hold_what_qwen_ships_and_transformers_saves(checkpoint, tmp_path):
    layer, dims = "model.language_model.layers.0.", random_dims(1)
    hidden, inter, experts = dims["hidden_size"], dims["moe_intermediate_size"], dims["num_experts"]
    tensors = Checkpoint.open(build_qwen3_5_moe_checkpoint(tmp_path, seed=1)).tensors  # the release
    assert tensors[layer + "mlp.experts.gate_up_proj"].torch_shape == (experts, 2 * inter, hidden)
    assert tensors[layer + "mlp.shared_expert_gate.weight"].torch_shape == (1, hidden)
    assert "model.visual.blocks.0.attn.qkv.weight" in tensors and "mtp.fc.weight" in tensors
    kinds = ["gdn" if t == "linear_attention" else "gqa" for t in dims["layer_types"]]
    assert [layer.attention.kind for layer in load_spec(checkpoint).layers] == kinds
    gdn = next(f"model.language_model.layers.{i}.linear_attn." for i, k in enumerate(kinds) if k == "gdn")
    assert tensors[gdn + "A_log"].dtype == "F32" and tensors[gdn + "conv1d.weight"].torch_shape[1:] == (1, 4)
    per_expert = Checkpoint.open(checkpoint).tensors
    assert per_expert[layer + f"mlp.experts.{experts - 1}.gate_proj.weight"].torch_shape == (inter, hidden)


def test_verify_passes_on_the_release_layout(tmp_path):
    """Seed 0 in the release layout (the per-expert layout: the LLM and server test below; the text-only
    type: tests/test_verify.py)."""
    result = verify_checkpoint(build_qwen3_5_moe_checkpoint(tmp_path, seed=0), prompt_len=70, decode_steps=6)
    assert result.passed and result.reference_consistent, result.first_divergence
    assert result.max_rel_err <= 1e-4 and result.model_type == "qwen3_5_moe"


def test_llm_api_and_server_give_transformers_step_logits(checkpoint):
    """Prompts of 5 to 70 tokens, 32 tokens a step: prompt chunks of several steps beside decodes; the second
    turn resumes from the snapshot of the first turn's states at its last block boundary."""
    hf = load_reference(checkpoint, torch.float32, "cpu")
    llm = assert_llm_matches_transformers(checkpoint, [5, 40, 70], hf, max_num_batched_tokens=32)
    assert llm.runner.snapshots.restored >= 1
    assert_server_matches_transformers(checkpoint, [9, 66], hf)


def test_bfloat16_runs_close_to_float32_and_holds_the_planned_bytes(checkpoint):
    assert_bf16_close_and_planned(checkpoint, 40, 256)


def _config(**text):
    return {"model_type": "qwen3_5_moe", "text_config": {**random_dims(0), **text}}


@pytest.mark.parametrize("config, field", [
    ({**_config(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config.quant_method"),
    (_config(attn_output_gate=False), "attn_output_gate"),
    (_config(linear_num_key_heads=2, linear_num_value_heads=3), "linear_num_value_heads"),
    (_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
     "rope_parameters.rope_type"),
    (_config(layer_types=["linear_attention", "sliding_attention", "full_attention", "full_attention"]), "layer_types"),
    ({**_config(), "text_config": {**_config()["text_config"], "model_type": "qwen3_next"}}, "text_config.model_type"),
])
def test_unsupported_configs_are_refused_by_inspect_and_loader(tmp_path, config, field):
    assert_refused(tmp_path, config, field)
