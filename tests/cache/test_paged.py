"""Paged storage: the layout a model's probe finds, the step metadata (write slots, right-aligned
reads, lengths), and the views: what a paged step returns equals the contiguous reference cache."""

import pytest
import torch

from dayzero.cache import BlockPool, KVCacheManager
from dayzero.cache.paged import (CacheLayout, PagedKVStorage, PagedStepCache, StateSpec, StreamSpec, build_step,
                                 probe_layout)
from dayzero.engine.request import Request

BS = 4
LAYOUT = CacheLayout(
    streams=[StreamSpec(0, "k", (3,), torch.float32, None), StreamSpec(0, "w", (2,), torch.float32, 6),
             StreamSpec(0, "c", (3,), torch.float32, None, rate=4), StreamSpec(1, "k", (2, 2), torch.bfloat16, None)],
    states=[StateSpec(0, "s", (2, 2), torch.float32)])


def _setup():
    kv = KVCacheManager([BlockPool(32), BlockPool(32)], BS, enable_prefix_caching=False, windows=LAYOUT.windows)
    storage = PagedKVStorage(LAYOUT, [32, 32], BS, num_state_slots=2, num_snapshots=0, device="cpu")
    return kv, storage


def _run(kv, storage, reqs, starts, n, slots):
    for r, start in zip(reqs, starts):
        r.num_computed_tokens = start
        assert kv.allocate_slots(r, n)
    ctx = build_step([kv.block_tables[r.request_id] for r in reqs], starts, n, LAYOUT, BS, slots, "cpu")
    return PagedStepCache(storage, ctx, 2)


def test_layout_groups_pages_and_entry_rates():
    assert LAYOUT.windows == (None, 6)
    # full group per block: k 4 x 3 fp32 = 48 B, c one entry of 3 fp32 = 12 -> 16 aligned, k' 4 x 4 bf16 = 32
    assert LAYOUT.page_bytes(BS) == [48 + 16 + 32, 32]
    assert LAYOUT.state_bytes == 16
    with pytest.raises(ValueError, match="block_size 6 does not fit"):
        StreamSpec(0, "c", (3,), torch.float32, None, rate=4).entries_per_block(6)


def test_paged_steps_return_what_a_contiguous_cache_holds():
    kv, storage = _setup()
    a, b = Request("a", list(range(40))), Request("b", list(range(40)))
    truth = {r: {"k": torch.randn(20, 3), "w": torch.randn(20, 2), "c": torch.randn(5, 3), "k1": torch.randn(20, 2, 2)}
             for r in "ab"}
    # prefill a: 9 tokens, b: 6 tokens (each alone, as the prefill path runs them)
    for req, n in ((a, 9), (b, 6)):
        t = truth[req.request_id]
        cache = _run(kv, storage, [req], [0], n, [0 if req is a else 1])
        view = cache.layers[0]
        assert torch.equal(view.append("k", t["k"][None, :n]), t["k"][None, :n])
        assert torch.equal(view.append("w", t["w"][None, :n], 6), t["w"][None, :n])
        assert torch.equal(view.append("c", t["c"][None, :n // 4], rate=4), t["c"][None, :n // 4])
        got = cache.layers[1].append("k", t["k1"][None, :n])
        assert got.dtype == torch.bfloat16 and torch.equal(got.float(), t["k1"][None, :n].bfloat16().float())
        assert view.lens("k") is None and view.get("s") is None  # a fresh prefill has no state yet
        view["s"] = torch.full((1, 2, 2), float(n))
        req.num_computed_tokens = n
        kv.cache_full_blocks(req)
    # one decode step of both rows together: a at position 9, b at 6
    cache = _run(kv, storage, [a, b], [9, 6], 1, [0, 1])
    view = cache.layers[0]
    k = view.append("k", torch.stack([truth["a"]["k"][9:10], truth["b"]["k"][6:7]]))
    assert k.shape == (2, 10, 3) and torch.equal(view.lens("k"), torch.tensor([10, 7]))
    assert torch.equal(k[0], truth["a"]["k"][:10]) and torch.equal(k[1, 3:], truth["b"]["k"][:7])
    assert torch.equal(k[1, :3], truth["b"]["k"][:1].expand(3, 3))  # padding repeats the row's first entry
    w = view.append("w", torch.stack([truth["a"]["w"][9:10], truth["b"]["w"][6:7]]), 6)
    # the window reads the last 5 tokens before the new one: a 4..9, b 1..6
    assert torch.equal(w[0], truth["a"]["w"][4:10]) and torch.equal(w[1, 0], truth["b"]["w"][1])
    assert torch.equal(w[1], truth["b"]["w"][1:7]) and view.lens("w") is None  # both rows read 6: no padding
    assert torch.equal(view["s"][:, 0, 0], torch.tensor([9.0, 6.0]))  # each row's own state slot
    with pytest.raises(ValueError, match="appends 0 entries per row"):  # neither row completes an entry of 4
        view.append("c", torch.zeros(2, 1, 3), rate=4)
    with pytest.raises(KeyError, match="no cache stream 'v'"):
        view.append("v", torch.zeros(2, 1, 3))
    kv.free(a)
    kv.free(b)


def test_rows_appending_different_numbers_of_compressed_entries_cannot_share_a_forward():
    kv, _ = _setup()
    a, b = Request("a", list(range(20))), Request("b", list(range(20)))
    kv.match_prefix(a), kv.match_prefix(b)
    for r, start in ((a, 7), (b, 5)):
        r.num_computed_tokens = start
        assert kv.allocate_slots(r, 1)
    with pytest.raises(ValueError, match="different numbers of 4-token entries"):
        build_step([kv.block_tables["a"], kv.block_tables["b"]], [7, 5], 1, LAYOUT, BS, [0, 1], "cpu")
    kv.free(a), kv.free(b)


@pytest.mark.parametrize("name", ["deepseek_v32", "deepseek_v4", "gpt_oss", "kimi_linear"])
def test_probe_finds_every_stream_and_state(name, tmp_path):
    from dayzero.models import load_model
    from tests.engine.test_llm import FAMILIES

    model = load_model(FAMILIES[name][0](tmp_path), dtype=torch.float32)
    layout = probe_layout(model)
    kinds = {(s.name, s.window, s.rate) for s in layout.streams}
    if name == "deepseek_v32":
        assert {n for n, _, _ in kinds} == {"kv_latent", "k_pe", "index_k"} and not layout.states
    if name == "gpt_oss":
        assert layout.windows == (None, model.config["sliding_window"]) and not layout.states
    if name == "kimi_linear":  # MLA layers stream their latents, KDA layers keep conv + recurrent states
        assert {n for n, _, _ in kinds} == {"kv_latent", "k_pe"}
        assert {s.name for s in layout.states} == {"conv_q", "conv_k", "conv_v", "recurrent"}
    if name == "deepseek_v4":
        assert {r for _, _, r in kinds} == {1, 4, 128} and len(layout.windows) == 2
        assert {s.name for s in layout.states} >= {"comp_pending_kv", "comp_prev_kv", "index_pending_gate"}
