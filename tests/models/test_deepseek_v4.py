"""DeepSeek-V4 against transformers on a tiny random checkpoint in the real on-disk layout.

Layers: window only, CSA (ratio 4, indexer top-8), HCA (ratio 128), CSA, HCA; sliding window 16;
four hyper-connection streams; two hash-routed then three score-routed MoE layers with FP4 experts;
FP8 dense weights. transformers dequantizes FP8 and FP4 on load (CPU) to exactly the float32 values
our ops dequantize, so both sides run the same weights. Prompt lengths: 3 (no compressed entry at
all), 29 (CSA entries but fewer than top-k, past the window), 200 (CSA top-k selects among 50
entries, one HCA entry), 520 (four HCA entries, 130 CSA entries).
"""

import json

import pytest
import torch

from dayzero.formats import mxfp4
from dayzero.models import load_model
from tests.demo.test_checkpoint import expected_layout
from tests.models.deepseek_v4_checkpoints import (TINY_V4, build_deepseek_v4_checkpoint, load_reference, tiny_v4_config)
from tests.models.helpers import assert_refused, greedy, positions, rel_err

VOCAB = TINY_V4["vocab_size"]
LENGTHS = (3, 29, 200, 520)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_deepseek_v4_checkpoint(tmp_path_factory.mktemp("deepseek_v4"), mtp=True)


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_model(checkpoint, dtype=torch.float32, progress=False), load_reference(checkpoint)


def prompt(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_checkpoint_has_the_real_layout(checkpoint):
    from dayzero.weights import Checkpoint

    config = json.loads((checkpoint / "config.json").read_text())
    found = {name: (info.dtype, info.torch_shape) for name, info in Checkpoint.open(checkpoint).tensors.items()}
    mtp = {name for name in found if name.startswith("mtp.0.")}
    assert mtp and {n: found[n] for n in found if n not in mtp} == expected_layout(config)
    assert config["quantization_config"]["scale_fmt"] == "ue8m0" and config["expert_dtype"] == "fp4"
    assert set(config["compress_ratios"][: config["num_hidden_layers"]]) == {0, 4, 128}
    # the regimes the prompt lengths are chosen for
    assert 29 // 4 < config["index_topk"] < 200 // 4 and 520 // 128 >= 4
    assert config["sliding_window"] < 29


def test_weights_stay_packed_and_equal_what_transformers_dequantizes(models):
    ours, ref = models
    for i, (block, layer) in enumerate(zip(ours.layers, ref.model.layers)):
        experts = block.ffn.experts
        assert experts.w13.dtype == torch.uint8 and block.attn.wq_a.weight.dtype == torch.float8_e4m3fn
        w13 = mxfp4.dequantize(experts.w13, experts.w13_scale, dtype=torch.float32)
        assert torch.equal(w13, layer.mlp.experts.gate_up_proj.detach())
        assert torch.equal(mxfp4.dequantize(experts.w2, experts.w2_scale, dtype=torch.float32),
                           layer.mlp.experts.down_proj.detach())
        if block.ffn.gate.hashed:
            assert torch.equal(block.ffn.gate.tid2eid, layer.mlp.gate.tid2eid)


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_transformers(models, length):
    ours, ref = models
    ids = prompt(length, seed=length)
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids, positions(ids))
    assert got.dtype == torch.float32 and got.shape == (1, length, VOCAB)
    err = rel_err(got, want)
    print(f"\ndeepseek_v4 float32 prompt {length}: max relative logits error {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("length", [5, 250])
def test_greedy_generation_matches_transformers(models, length):
    """32 tokens: from 5 the decode crosses the window and the first CSA selections; from 250 it
    crosses the second HCA window (position 255)."""
    ours, ref = models
    ids = prompt(length, seed=100 + length)
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                            min_new_tokens=32, pad_token_id=VOCAB - 1)[:, length:]
        tokens, _ = greedy(ours, ids, 32)
    assert tokens.tolist() == want.tolist()


def test_decode_and_chunked_prefill_equal_one_forward(models):
    """The cache carries the window keys, the compressors' unfinished windows and CSA's overlap window."""
    ours, _ = models
    ids = prompt(270, seed=7)
    with torch.no_grad():
        full = ours(ids, positions(ids))
        for prefill, stop in ((1, 40), (6, 24), (120, 140)):  # (120, 140): an HCA entry appears mid-decode
            cache = ours.new_cache(1)
            steps = [ours(ids[:, :prefill], positions(ids[:, :prefill]), cache)]
            for i in range(prefill, stop):
                steps.append(ours(ids[:, i:i + 1], positions(ids[:, i:i + 1], i), cache))
            assert cache.length == stop
            assert rel_err(torch.cat(steps, 1), full[:, :stop]) <= 1e-5, prefill
        cache, start, chunks = ours.new_cache(1), 0, []
        for size in (3, 6, 1, 117, 9, 2, 130, 2):  # ragged chunks across every window boundary kind
            chunks.append(ours(ids[:, start:start + size], positions(ids[:, start:start + size], start), cache))
            start += size
    assert start == 270 and rel_err(torch.cat(chunks, 1), full) <= 1e-5


def test_batch_rows_are_independent(models):
    ours, _ = models
    ids = prompt(41, seed=9, batch=2)
    with torch.no_grad():
        both = ours(ids, positions(ids))
        for row in range(2):
            assert rel_err(both[row:row + 1], ours(ids[row:row + 1], positions(ids[row:row + 1]))) <= 1e-5
        tokens, _ = greedy(ours, ids, 6)
        for row in range(2):
            assert tokens[row].tolist() == greedy(ours, ids[row:row + 1], 6)[0][0].tolist()


def test_bfloat16_runs(checkpoint, models):
    ours32, _ = models
    ours = load_model(checkpoint, dtype=torch.bfloat16, progress=False)
    ids = prompt(140, seed=11)
    with torch.no_grad():
        logits = ours(ids, positions(ids))
        tokens, step_logits = greedy(ours, ids[:, :130], 4)
        reference = ours32(ids, positions(ids))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all() and torch.isfinite(step_logits).all()
    assert ours.embed.weight.dtype == torch.bfloat16 and ours.layers[0].hc_attn_fn.dtype == torch.float32
    # bf16 rounding through five layers: transformers' own bf16 run is as far from float32 (~4% mean)
    assert float((logits - reference).abs().mean() / reference.abs().mean()) < 0.1
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("variant, options, expert_dtype", [
    ("fp8_experts", dict(expert_dtype="fp8", moe_intermediate_size=128), torch.float8_e4m3fn),
    ("unquantized", dict(quantized=False), torch.float32),
])
def test_other_weight_formats_match_transformers(tmp_path, variant, options, expert_dtype):
    path = build_deepseek_v4_checkpoint(tmp_path, **options)
    ours, ref = load_model(path, dtype=torch.float32, progress=False), load_reference(path)
    assert ours.layers[2].ffn.experts.w13.dtype == expert_dtype
    ids = prompt(140, seed=3)
    with torch.no_grad():
        err = rel_err(ours(ids, positions(ids)), ref(ids).logits)
    print(f"\ndeepseek_v4 {variant}, prompt 140: max relative logits error {err:.2e}")
    assert err <= 1e-4


def test_demo_checkpoint_matches_transformers():
    """The embedded demo (4 indexer heads, top-4) has exact zero-score ties in the indexer; both sides
    rank them by entry index (load_reference patches transformers' indexer), so those positions agree."""
    from dayzero.demo import demo_checkpoint

    path = demo_checkpoint()
    ours, ref = load_model(path, dtype=torch.float32, progress=False), load_reference(path)
    ids = torch.randint(0, ref.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(64))
    with torch.no_grad():
        err = rel_err(ours(ids, positions(ids)), ref(ids).logits)
        want = ref.generate(ids[:, :20], attention_mask=torch.ones_like(ids[:, :20]), do_sample=False,
                            max_new_tokens=16, min_new_tokens=16, pad_token_id=0)[:, 20:]
        tokens, _ = greedy(ours, ids[:, :20], 16)
    print(f"\ndeepseek_v4 demo checkpoint, prompt 160: max relative logits error {err:.2e}")
    assert err <= 1e-4 and tokens.tolist() == want.tolist()


@pytest.mark.parametrize("field, value", [
    ("scoring_func", "softmax"),
    ("num_key_value_heads", 2),
    ("o_lora_rank", 64),  # FP8 blocks of 128 rows cannot be split between 2 output groups of 64
    ("n_shared_experts", 2),
    ("norm_topk_prob", False),
    ("attention_bias", True),
])
def test_unsupported_options_are_refused_by_inspect_and_loader(tmp_path, field, value):
    assert_refused(tmp_path, tiny_v4_config(**{field: value}), field)


def test_a_decode_step_runs_every_sequence_in_one_block_whatever_its_window_phase(checkpoint):
    """Sequences at every position modulo the CSA ratio (and one completing an HCA window) decode in one
    block, reading the paged streams in place: each compressor and the paged attention run once per step
    and layer (not once per phase), the gathered sparse_attention not at all (prompts read in place too),
    and the batch's tokens equal each prompt's alone."""
    from dayzero import LLM, SamplingParams
    from dayzero.ops.registry import REGISTRY

    llm = LLM(checkpoint, dtype="float32")
    prompts = [prompt(n, seed=n)[0].tolist() for n in (29, 30, 31, 32, 127)]  # 127 + 1: an HCA entry completes
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", *engine.validate(p, params))
    calls, tokens = [], {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        with REGISTRY.record_calls() as step_calls:
            for update in engine.step():
                tokens[update.request_id] += update.new_token_ids
        calls.append(dict(step_calls))
    compressors = sum(2 if r == 4 else 1 for r in TINY_V4["compress_ratios"] if r)  # CSA: attention + indexer
    layers = len(TINY_V4["compress_ratios"])
    assert not any("sparse_attention" in c for c in calls)  # every block, prompts too, reads the pool in place
    decodes = [c for c in calls if c.get("paged_v4_attention") == layers]  # one block a step
    assert len(decodes) >= 4 and all(c["kv_compressor"] == compressors and c["paged_v4_index_topk"] == TINY_V4["compress_ratios"].count(4)
                                     for c in decodes), calls
    batched = [tokens[f"r{i}"] for i in range(len(prompts))]
    alone = [o.token_ids for p in prompts for o in llm.generate([p], params)]
    assert batched == alone


def test_a_prompt_in_query_chunks_gives_the_one_pass_logits(models, monkeypatch):
    """Budgets that cut a 200-token prompt's indexer scores and attention into chunks of a few queries
    (what bounds their memory at long context) leave the logits as one pass gives them."""
    from dayzero.ops import attention_v4

    ours, _ = models
    ids = prompt(200, seed=3)
    with torch.no_grad():
        whole = ours(ids, positions(ids))
    monkeypatch.setattr(attention_v4, "query_chunks", lambda queries, keys, heads: 7)
    monkeypatch.setattr(attention_v4, "SCORE_ELEMENTS", 4096)
    assert attention_v4.attention_chunk(200, TINY_V4["sliding_window"], TINY_V4["num_attention_heads"]) < 30
    with torch.no_grad():
        chunked = ours(ids, positions(ids))
    assert rel_err(chunked, whole) <= 1e-6
