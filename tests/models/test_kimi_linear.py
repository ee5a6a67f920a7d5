"""Kimi Linear against transformers on tiny random checkpoints in the released bf16 layout.

Two KDA layers (the first with a dense MLP) and two NoPE MLA layers (MoE, group-limited routing).
Prompts of 5 tokens stay inside one KDA chunk (64); 150 tokens span three chunks, the last partial;
generation runs 32 tokens further through the recurrent (decode) form.
"""

import json

import pytest
import torch

from dayzero.models import load_model
from dayzero.spec import load_spec
from tests.models.helpers import assert_greedy_matches_transformers, assert_logits_match_transformers, assert_refused
from tests.models.kimi_linear_checkpoints import (DIMS, KDA_HEAD_DIM, KDA_HEADS, build_kimi_linear_checkpoint, load_reference,
                                                  positions, prompt, rel_err)

VOCAB = DIMS["vocab_size"]
VARIANTS = {"q_proj": {}, "q_lora": {"q_lora_rank": 24}}


@pytest.fixture(autouse=True)
def _private_rng():
    """Deterministic draws here, and the global generator left as other test files expect it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return build_kimi_linear_checkpoint(tmp_path_factory.mktemp("kimi_linear"), **VARIANTS[request.param])


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_model(checkpoint, dtype=torch.float32, progress=False), load_reference(checkpoint)


def test_checkpoint_has_the_released_layout(checkpoint):
    from dayzero.weights import Checkpoint

    tensors = Checkpoint.open(checkpoint).tensors
    kda, mla = "model.layers.0.self_attn.", "model.layers.1."
    width = KDA_HEADS * KDA_HEAD_DIM
    assert tensors[kda + "q_conv1d.weight"].torch_shape == (width, 1, 4)
    assert tensors[kda + "A_log"].torch_shape == (1, 1, KDA_HEADS, 1)
    assert tensors[kda + "dt_bias"].dtype == "F32" and tensors[kda + "f_b_proj.weight"].dtype == "BF16"
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # dense layer: `mlp`, as released
    assert tensors[mla + "block_sparse_moe.experts.3.w1.weight"].torch_shape == (DIMS["moe_intermediate_size"], DIMS["hidden_size"])
    assert tensors[mla + "block_sparse_moe.gate.e_score_correction_bias"].dtype == "F32"
    assert mla + "self_attn.kv_b_proj.weight" in tensors
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["mla_use_nope"] is True and config["linear_attn_config"]["kda_layers"] == [1, 3]
    assert [layer.attention.kind for layer in load_spec(checkpoint).layers] == ["kda", "mla", "kda", "mla"]


def test_experts_hold_the_weights_transformers_loads(models):
    ours, hf = models
    for layer_ours, layer_hf in zip(ours.model.layers[1:], hf.model.layers[1:]):
        e = layer_ours.block_sparse_moe.experts
        assert torch.equal(e.w13, layer_hf.mlp.experts.gate_up_proj.detach())
        assert torch.equal(e.w2, layer_hf.mlp.experts.down_proj.detach())


@pytest.mark.parametrize("length", (5, 150))
def test_logits_match_transformers(models, length):
    ours, hf = models
    assert_logits_match_transformers(ours, hf, prompt(2, length), VOCAB)


@pytest.mark.parametrize("length", (5, 150))
def test_greedy_generation_matches_transformers(models, length):
    ours, hf = models
    assert_greedy_matches_transformers(ours, hf, prompt(1, length, seed=1))


def test_chunked_prefill_matches_full_forward(models):
    """Ragged prefill pieces (inside a chunk, across chunk edges, one token) continue the conv and
    recurrent states and the MLA latents exactly where the previous call left them."""
    ours, _ = models
    ids = prompt(3, 150, seed=2)
    cache = ours.new_cache(3)
    pieces, start = [], 0
    with torch.no_grad():
        for size in (7, 1, 60, 2, 80):
            chunk = ids[:, start:start + size]
            pieces.append(ours(chunk, positions(chunk, start), cache))
            start += size
        full = ours(ids, positions(ids))
    assert cache.length == 150
    states = cache.storage.states  # per sequence slot: KDA's fixed-size state; MLA layers cache per token
    assert states[0, "recurrent"].shape == (3, KDA_HEADS, KDA_HEAD_DIM, KDA_HEAD_DIM)
    assert states[0, "recurrent"].dtype == torch.float32
    assert states[0, "conv_q"].shape == (3, KDA_HEADS * KDA_HEAD_DIM, 3)
    assert cache.storage.specs[1, "kv_latent"].shape == (DIMS["kv_lora_rank"],) and (1, "recurrent") not in states
    assert rel_err(torch.cat(pieces, dim=1), full) <= 1e-5


def test_bfloat16_runs_close_to_float32(checkpoint, models):
    """bf16 differs from float32 by rounding, and now and then by a routing decision that flips:
    most positions stay within bf16 rounding of float32."""
    ours32, _ = models
    ours16 = load_model(checkpoint, dtype=torch.bfloat16, progress=False)
    ids = prompt(2, 40, seed=4)
    with torch.no_grad():
        got = ours16(ids, positions(ids))
        want = ours32(ids, positions(ids))
        cache = ours16.new_cache(2)
        ours16(ids[:, :39], positions(ids[:, :39]), cache)
        step = ours16(ids[:, 39:], positions(ids[:, 39:], 39), cache)
    assert got.dtype == torch.float32 and torch.isfinite(got).all() and torch.isfinite(step).all()
    per_position = (got - want).abs().amax(-1) / want.abs().amax(-1)
    assert float(per_position.median()) <= 3e-2
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8


def _config(**changes):
    config = {"model_type": "kimi_linear", **DIMS, "mla_use_nope": True, "moe_router_activation_func": "sigmoid",
              "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 2, "head_dim": 16,
                                     "short_conv_kernel_size": 4}}
    config.update(changes)
    return config


@pytest.mark.parametrize("changes, field", [
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(num_expert_group=3), "num_expert_group"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "quantization_config.quant_method"),
])
def test_unsupported_config_is_refused_by_inspect_and_loader(tmp_path, changes, field):
    assert_refused(tmp_path, _config(**changes), field)
