"""DeepSeek-V3.2 (V3 + DeepSeek Sparse Attention) against transformers, tiny real-layout FP8 checkpoint.

index_topk is 8: a 5-token prompt runs dense MLA (every key is selected), 40- and 45-token prompts
and the decode steps past 8 cached tokens run the indexer, top-k and sparse MLA.
"""

import pytest
import torch

from dayzero.models import load_model
from tests.models.deepseek_checkpoints import (V3_DIMS, V32_DIMS, build_deepseek_v32_checkpoint, load_reference,
                                              positions, prompt, rel_err)
from tests.models.helpers import assert_greedy_matches_transformers, assert_refused

TOPK = V32_DIMS["index_topk"]



@pytest.fixture(autouse=True)
def _private_rng():
    """Deterministic draws here, and the global generator left as other test files expect it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_deepseek_v32_checkpoint(tmp_path_factory.mktemp("deepseek_v32"))


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_model(checkpoint, dtype=torch.float32, progress=False), load_reference(checkpoint)


def test_checkpoint_has_the_real_layout(checkpoint):
    from dayzero.weights import Checkpoint

    tensors = Checkpoint.open(checkpoint).tensors
    indexer = "model.layers.0.self_attn.indexer."
    assert tensors[indexer + "wq_b.weight"].dtype == "F8_E4M3" and tensors[indexer + "wk.weight_scale_inv"].dtype == "F32"
    assert tensors[indexer + "weights_proj.weight"].dtype == "BF16"
    assert tensors[indexer + "k_norm.bias"].torch_shape == (V32_DIMS["index_head_dim"],)
    assert tensors["model.layers.2.mlp.experts.7.up_proj.weight"].dtype == "F8_E4M3"


@pytest.mark.parametrize("length", (5, TOPK, 45))
def test_logits_match_transformers(models, length):
    ours, hf = models
    ids = prompt(2, length)
    with torch.no_grad():
        got, want = ours(ids, positions(ids)), hf(ids).logits
    err = rel_err(got, want)
    print(f"max relative logits error, prompt {length} (index_topk {TOPK}): {err:.2e}")
    assert err <= 1e-4


def test_sparse_regime_is_exercised(models):
    """Past index_topk keys the selection matters: dense attention over every key gives other logits."""
    ours, hf = models
    ids = prompt(2, 45)
    with torch.no_grad():
        want = hf(ids).logits
        indexers = [layer.self_attn.indexer for layer in ours.model.layers]
        for indexer in indexers:
            indexer.topk = 10**9
        try:
            dense = ours(ids, positions(ids))
        finally:
            for indexer in indexers:
                indexer.topk = TOPK
    assert rel_err(dense[:, :TOPK], want[:, :TOPK]) <= 1e-4  # the first index_topk queries see at most topk keys
    assert rel_err(dense, want) > 1e-2


@pytest.mark.parametrize("length", (5, 40))
def test_greedy_generation_matches_transformers(models, length):
    ours, hf = models
    assert_greedy_matches_transformers(ours, hf, prompt(1, length, seed=1))


def test_chunked_prefill_matches_full_forward(models):
    """Chunks that start past index_topk cached keys: causal top-k aligned to the cache's end."""
    ours, _ = models
    ids = prompt(2, 45, seed=7)
    cache = ours.new_cache(2)
    with torch.no_grad():
        parts = [ours(ids[:, a:b], positions(ids[:, a:b], a), cache) for a, b in ((0, 6), (6, 20), (20, 21), (21, 45))]
        full = ours(ids, positions(ids))
    assert rel_err(torch.cat(parts, dim=1), full) <= 1e-5


def test_cache_keeps_indexer_keys(models):
    ours, _ = models
    ids = prompt(2, 11, seed=5)
    cache = ours.new_cache(2)
    with torch.no_grad():
        ours(ids, positions(ids), cache)
    layer = cache.layers[0]
    assert layer["kv_latent"].shape == (2, 11, V3_DIMS["kv_lora_rank"])
    assert layer["k_pe"].shape == (2, 11, V3_DIMS["qk_rope_head_dim"])
    assert layer["index_k"].shape == (2, 11, V32_DIMS["index_head_dim"])


def test_bfloat16_runs(checkpoint, models):
    ours32, _ = models
    ours16 = load_model(checkpoint, dtype=torch.bfloat16, progress=False)
    ids = prompt(1, 30, seed=6)
    with torch.no_grad():
        got, want = ours16(ids, positions(ids)), ours32(ids, positions(ids))
    assert torch.isfinite(got).all()
    assert float(((got - want).abs().amax(-1) / want.abs().amax(-1)).median()) <= 5e-2


def test_v32_needs_the_q_latent(tmp_path):
    assert_refused(tmp_path, {"model_type": "deepseek_v32", **V3_DIMS, **V32_DIMS, "q_lora_rank": None}, "q_lora_rank")


def test_block_wise_prefill_equals_transformers(models, monkeypatch):
    """Queries scored and attended in blocks of 7 (each block sees the keys up to its last query)
    give the one-block result."""
    from dayzero.models import deepseek_v3

    ours, hf = models
    ids = prompt(2, 45)
    with torch.no_grad():
        whole = ours(ids, positions(ids))
        monkeypatch.setattr(deepseek_v3, "QUERY_BLOCK", 7)
        blocks = ours(ids, positions(ids))
        want = hf(ids).logits
    assert rel_err(blocks, whole) <= 1e-5 and rel_err(blocks, want) <= 1e-4
