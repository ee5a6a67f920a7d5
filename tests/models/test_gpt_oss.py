"""gpt-oss against transformers on tiny random checkpoints in the real MXFP4 layout.

transformers dequantizes the MXFP4 experts on load (to float32 with dtype=float32, bit-exactly the
values dayzero's op dequantizes per expert), so both sides run the same weights. Prompts of 5 tokens
sit inside the sliding window (8); 40 and 70 tokens are several windows long.
"""

import json

import pytest
import torch

from dayzero.formats import mxfp4
from dayzero.models import load_model
from tests.models.gpt_oss_checkpoints import TINY, build_gpt_oss_checkpoint
from tests.models.helpers import assert_refused, positions, random_prompt, rel_err

WINDOW = TINY["sliding_window"]
PROMPT_LENGTHS = (5, 40, 70)


def _hf(path):
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from dayzero.verify import reference_load_kwargs

    kwargs = reference_load_kwargs(json.loads((Path(path) / "config.json").read_text()))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()


def _prompt(batch, length, seed=0):
    return random_prompt(batch, length, TINY["vocab_size"], seed + length)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_model(checkpoint, dtype=torch.float32, progress=False), _hf(checkpoint)


def test_checkpoint_has_the_published_layout(checkpoint):
    from dayzero.weights import Checkpoint

    tensors = Checkpoint.open(checkpoint).tensors
    e, h, i = TINY["num_local_experts"], TINY["hidden_size"], TINY["intermediate_size"]
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert (blocks.dtype, blocks.torch_shape) == ("U8", (e, 2 * i, h // 32, 16))
    assert tensors["model.layers.0.mlp.experts.down_proj_scales"].torch_shape == (e, h, i // 32)
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype == "BF16"
    assert tensors["model.layers.0.self_attn.sinks"].dtype == "BF16"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4" and "rope_scaling" in config


def test_experts_hold_the_weights_transformers_dequantizes(models):
    ours, hf = models
    i = TINY["intermediate_size"]
    for layer_ours, layer_hf in zip(ours.model.layers, hf.model.layers):
        e_ours, e_hf = layer_ours.mlp.experts, layer_hf.mlp.experts
        assert e_hf.gate_up_proj.dtype == torch.float32
        gate_up = e_hf.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], rows gate, up, gate, up, ...
        w13 = mxfp4.dequantize(e_ours.w13, e_ours.w13_scale, torch.float32)
        assert torch.equal(w13[:, :i], gate_up[:, 0::2]) and torch.equal(w13[:, i:], gate_up[:, 1::2])
        w2 = mxfp4.dequantize(e_ours.w2, e_ours.w2_scale, torch.float32)
        assert torch.equal(w2, e_hf.down_proj.detach().transpose(1, 2))
        bias = e_hf.gate_up_proj_bias.detach()
        assert torch.equal(e_ours.b13, torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1))


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_logits_match_transformers(models, length):
    ours, hf = models
    ids = _prompt(2, length)
    with torch.no_grad():
        got, expected = ours(ids, positions(ids)), hf(ids).logits
    assert got.dtype == torch.float32 and got.shape == (2, length, TINY["vocab_size"])
    assert rel_err(got, expected) <= 1e-4


@pytest.mark.parametrize("length", (5, 40))
def test_prefill_then_decode_matches_full_forward(models, length):
    ours, _ = models
    ids = _prompt(2, length + 12)
    with torch.no_grad():
        full = ours(ids, positions(ids))
        cache = ours.new_cache(2)
        steps = [ours(ids[:, :length], positions(ids[:, :length]), cache)]
        chunks = [(length, length + 1), (length + 1, length + 4), (length + 4, length + 12)]  # one token, then chunks
        for start, end in chunks:
            steps.append(ours(ids[:, start:end], positions(ids[:, start:end], start), cache))
    assert cache.length == length + 12
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-5


@pytest.mark.parametrize("length", (5, 40))
def test_greedy_generation_matches_transformers(models, length):
    ours, hf = models
    ids = _prompt(1, length, seed=7)
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)[0, length:]
        cache = ours.new_cache(1)
        logits = ours(ids, positions(ids), cache)
        generated = []
        for _ in range(32):
            token = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(int(token))
            logits = ours(token, positions(token, cache.length), cache)
    assert generated == expected.tolist()


def test_bfloat16_runs(checkpoint, models):
    """bf16 rounding flips routing decisions of some tokens in a random tiny model (transformers'
    bf16 model does too), so most tokens, not all, must stay close to float32."""
    ours32, _ = models
    ours = load_model(checkpoint, dtype=torch.bfloat16, progress=False)
    assert ours.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = _prompt(1, 16)
    with torch.no_grad():
        cache = ours.new_cache(1)
        got = torch.cat([ours(ids[:, :5], positions(ids[:, :5]), cache),
                         ours(ids[:, 5:], positions(ids[:, 5:], 5), cache)], dim=1)
        reference = ours32(ids, positions(ids))
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    per_token = (got - reference).abs().amax(-1) / reference.abs().amax(-1)
    assert per_token.median() <= 0.05


@pytest.mark.parametrize("options", [
    dict(expert_format="bf16", legacy_config=False),  # transformers' own unquantized save
    dict(tie_word_embeddings=True, num_hidden_layers=2),
    dict(attention_bias=False, num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]),
    dict(num_hidden_layers=2, num_key_value_heads=4, sliding_window=3, swiglu_limit=3.0),
], ids=["bf16-experts", "tied", "no-bias", "mha-window3-limit3"])
def test_variants_match_transformers(tmp_path, options):
    path = build_gpt_oss_checkpoint(tmp_path, seed=1, **options)
    ours, hf = load_model(path, dtype=torch.float32, progress=False), _hf(path)
    for length in (5, 40):
        ids = _prompt(1, length)
        with torch.no_grad():
            assert rel_err(ours(ids, positions(ids)), hf(ids).logits) <= 1e-4


@pytest.mark.parametrize("changes, field", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(intermediate_size=48), "intermediate_size"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "quantization_config.quant_method"),
])
def test_unsupported_options_are_refused_by_inspect_and_loader(tmp_path, changes, field):
    config = {"model_type": "gpt_oss", **TINY, "quantization_config": dict(quant_method="mxfp4"), **changes}
    assert_refused(tmp_path, config, field)
