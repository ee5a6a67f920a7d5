"""The cache layout of a spec: it is what every family's model writes (probed), the paged storage
allocates exactly its page bytes, and the memory plan (`dayzero inspect`) reports those same bytes
for every family and kv_cache_dtype."""

import random

import pytest
import torch

from dayzero.cache.layout import DEFAULT_BLOCK_SIZE, CacheLayout, StateSpec, StreamSpec, cache_layout, window_blocks
from dayzero.cache.paged import PagedKVStorage, checked_layout, probe_layout
from dayzero.plan import GIB, KV_DTYPES, cache_totals, memory_plan
from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint, build_deepseek_v32_checkpoint
from tests.models.deepseek_v4_checkpoints import build_deepseek_v4_checkpoint
from tests.models.glm4_moe_checkpoints import build_glm4_moe_checkpoint
from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint
from tests.models.kimi_k3_checkpoints import build_kimi_k3_checkpoint
from tests.models.kimi_linear_checkpoints import build_kimi_linear_checkpoint
from tests.models.qwen3_5_moe_checkpoints import build_qwen3_5_moe_checkpoint

_rng = random.Random(25)
BUILDERS = {
    "deepseek_v3": build_deepseek_v3_checkpoint,
    # seeded odd widths: a page's alignment padding shows
    "kimi_k2": lambda d: build_deepseek_v3_checkpoint(d, model_type="kimi_k2", kv_lora_rank=_rng.choice([12, 20, 28]),
                                                      qk_rope_head_dim=_rng.choice([6, 10])),
    "deepseek_v32": build_deepseek_v32_checkpoint,
    "deepseek_v4": build_deepseek_v4_checkpoint,
    "gpt_oss": build_gpt_oss_checkpoint,
    "kimi_linear": build_kimi_linear_checkpoint,
    "kimi_k3": build_kimi_k3_checkpoint,
    "glm4_moe": build_glm4_moe_checkpoint,
    "qwen3_5_moe": build_qwen3_5_moe_checkpoint,
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model(request, tmp_path_factory):
    from dayzero.models import load_model

    return load_model(BUILDERS[request.param](tmp_path_factory.mktemp(request.param)), dtype=torch.bfloat16)


def _key(layout: CacheLayout):
    return sorted(map(repr, layout.streams)), sorted(map(repr, layout.states))


def test_the_spec_layout_is_what_the_model_writes(model):
    probed = probe_layout(model)
    assert _key(cache_layout(model.spec, torch.bfloat16)) == _key(probed)
    kinds = {s.name for s in probed.streams} | {s.name for s in probed.states}
    t = model.spec.model_type
    if t in ("deepseek_v3", "kimi_k2"):
        assert kinds == {"kv_latent", "k_pe"}
    if t == "deepseek_v32":
        assert kinds == {"kv_latent", "k_pe", "index_k"}
    if t == "gpt_oss":
        assert probed.windows == (None, model.config["sliding_window"]) and not probed.states
    if t == "qwen3_5_moe":  # full attention streams K and V, Gated DeltaNet layers keep conv + recurrent states
        assert kinds == {"k", "v", "conv", "recurrent"} and probed.windows == (None,)
    if t == "kimi_linear":  # MLA layers stream their latents, KDA layers keep conv + recurrent states
        assert kinds == {"kv_latent", "k_pe", "conv_q", "conv_k", "conv_v", "recurrent"}
    if t == "deepseek_v4":
        assert {s.rate for s in probed.streams} == {1, 4, 128} and len(probed.windows) == 2
        assert kinds >= {"comp_pending_kv", "comp_prev_kv", "index_pending_gate", "index_entries"}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_the_memory_plan_counts_what_the_storage_allocates(model, kv_cache_dtype):
    """Per token: the full-attention pages; bounded: window_blocks pages per window group and one
    request's states; both read off the allocated tensors of a storage built from the probed layout."""
    kv_dtype = next(k for k, v in KV_DTYPES.items() if v == kv_cache_dtype)
    layout = probe_layout(model).with_kv_cache_dtype(kv_cache_dtype)
    for bs in (DEFAULT_BLOCK_SIZE, 4):
        storage = PagedKVStorage(layout, [3] * len(layout.windows), bs, num_state_slots=1, num_snapshots=0, device="cpu")
        page = [a.numel() // 3 for a in storage.arenas]
        state = sum(t.numel() * t.element_size() for t in storage.states.values())
        full = sum(p for w, p in zip(layout.windows, page) if w is None)
        bounded = sum(window_blocks(w, bs) * p for w, p in zip(layout.windows, page) if w is not None) + state
        assert cache_totals(model.spec, kv_dtype, bs) == (full / bs, bounded)
        if bs == DEFAULT_BLOCK_SIZE:  # what `dayzero inspect` prints
            plan = memory_plan(model.spec, kv_dtype=kv_dtype)
            assert plan.cache_bytes_per_token == full / bs
            assert plan.cache_fixed_gib * GIB == pytest.approx(bounded, rel=1e-12)


def test_fp8_mla_is_596_bytes_per_token_and_pages_are_aligned():
    mla = CacheLayout([StreamSpec(0, "kv_latent", (512,), torch.bfloat16, None),
                       StreamSpec(0, "k_pe", (64,), torch.bfloat16, None)], [])
    assert mla.with_kv_cache_dtype("fp8_e4m3").page_bytes(16) == [16 * (512 + 16 + 64 + 4)]
    # one entry per block (rate 128, blocks of 16): 36 B of e4m3 values and one 4 B scale, each aligned to 16 B
    hca = CacheLayout([StreamSpec(0, "comp", (36,), torch.bfloat16, None, rate=128)], [StateSpec(0, "s", (3,), torch.float32)])
    assert hca.page_bytes(16) == [80] and hca.with_kv_cache_dtype("fp8_e4m3").page_bytes(16) == [48 + 16]
    assert hca.sequence_bytes(16) == (80 / 16, 12)
    assert window_blocks(128, 16) == 9 and window_blocks(8, 4) == 3 and window_blocks(1, 16) == 1


def test_a_model_that_caches_something_else_is_refused(model, monkeypatch):
    from dayzero.cache import paged

    def one_stream_short(spec, dtype):
        full = cache_layout(spec, dtype)
        return CacheLayout(full.streams[1:], full.states)

    monkeypatch.setattr(paged, "cache_layout", one_stream_short)
    with pytest.raises(RuntimeError, match="planned but not written: \\[\\]"):
        checked_layout(model)
