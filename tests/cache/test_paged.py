"""Paged storage: the layout a model's probe finds, the packed step's metadata (positions, write
slots per group and rate, block tables, state slots) and the views: what a step writes, its streams
read back through the block tables, sequence by sequence."""

import pytest
import torch

from dayzero.cache import BlockPool, KVCacheManager
from dayzero.cache.paged import CacheLayout, PagedKVStorage, PagedStepCache, StateSpec, StreamSpec, probe_layout
from dayzero.cache.step import SeqStep, build_step
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


def _run(kv, storage, reqs, starts, counts, slots):
    steps = []
    for r, start, n, slot in zip(reqs, starts, counts, slots):
        r.num_computed_tokens = start
        assert kv.allocate_slots(r, n)
        steps.append(SeqStep(start, n, kv.block_tables[r.request_id], slot, token_ids=r.token_ids(start, start + n)))
    return PagedStepCache(storage, build_step(steps, LAYOUT, BS, "cpu"), 2)


def test_layout_groups_pages_and_entry_rates():
    assert LAYOUT.windows == (None, 6)
    # full group per block: k 4 x 3 fp32 = 48 B, c one entry of 3 fp32 = 12 -> 16 aligned, k' 4 x 4 bf16 = 32
    assert LAYOUT.page_bytes(BS) == [48 + 16 + 32, 32]
    assert LAYOUT.state_bytes == 16
    with pytest.raises(ValueError, match="block_size 6 does not fit"):
        StreamSpec(0, "c", (3,), torch.float32, None, rate=4).entries_per_block(6)


def test_packed_steps_write_entries_that_streams_read_back():
    kv, storage = _setup()
    a, b = Request("a", list(range(100, 140))), Request("b", list(range(200, 240)))
    for r in (a, b):
        kv.match_prefix(r)
    truth = {r: {"k": torch.randn(20, 3), "w": torch.randn(20, 2), "c": torch.randn(5, 3), "k1": torch.randn(20, 2, 2)}
             for r in "ab"}
    # one packed step: a prefills 9 tokens, b 6
    cache = _run(kv, storage, [a, b], [0, 0], [9, 6], [0, 1])
    meta = cache.meta
    assert meta.seqs.query_start_host == (0, 9, 15) and meta.seqs.seq_lens_host == (9, 6)
    assert meta.positions.tolist() == list(range(9)) + list(range(6))
    assert meta.input_ids.tolist() == list(range(100, 109)) + list(range(200, 206))
    assert meta.logits_indices.tolist() == [8, 14] and meta.fresh == (True, True)
    view = cache.layers[0]
    k = view.append("k", torch.cat([truth["a"]["k"][:9], truth["b"]["k"][:6]]))
    view.append("w", torch.cat([truth["a"]["w"][:9], truth["b"]["w"][:6]]), 6)
    with pytest.raises(ValueError, match="appends 3 entries"):  # a completes 2 entries of 4 tokens, b 1
        view.append("c", torch.zeros(2, 3), rate=4)
    view.append("c", torch.cat([truth["a"]["c"][:2], truth["b"]["c"][:1]]), rate=4)
    k1 = cache.layers[1].append("k", torch.cat([truth["a"]["k1"][:9], truth["b"]["k1"][:6]]))
    assert torch.equal(k.gather(0, 0, 9), truth["a"]["k"][:9]) and torch.equal(k.gather(1, 0, 6), truth["b"]["k"][:6])
    assert k1.data.dtype == torch.bfloat16
    assert torch.equal(k1.gather(1, 0, 6).float(), truth["b"]["k1"][:6].bfloat16().float())
    assert view.get("s") is None  # every sequence is fresh: no state to read yet
    view["s"] = torch.stack([torch.full((2, 2), 9.0), torch.full((2, 2), 6.0)])
    for r, n in ((a, 9), (b, 6)):
        r.num_computed_tokens = n
        kv.cache_full_blocks(r)
    # one decode step of both: a at position 9, b at 6; b's window page before token 1 may be gone
    cache = _run(kv, storage, [a, b], [9, 6], [1, 1], [0, 1])
    view = cache.layers[0]
    k = view.append("k", torch.stack([truth["a"]["k"][9], truth["b"]["k"][6]]))
    assert torch.equal(k.gather(0, 0, 10), truth["a"]["k"][:10]) and torch.equal(k.gather(1, 0, 7), truth["b"]["k"][:7])
    w = view.append("w", torch.stack([truth["a"]["w"][9], truth["b"]["w"][6]]), 6)
    assert torch.equal(w.gather(0, 4, 10), truth["a"]["w"][4:10]) and torch.equal(w.gather(1, 1, 7), truth["b"]["w"][1:7])
    c = view.append("c", torch.zeros(0, 3), rate=4)  # neither completes an entry
    assert torch.equal(c.gather(0, 0, 2), truth["a"]["c"][:2]) and torch.equal(c.gather(1, 0, 1), truth["b"]["c"][:1])
    assert torch.equal(view["s"][:, 0, 0], torch.tensor([9.0, 6.0]))  # each sequence's own state slot
    with pytest.raises(KeyError, match="no cache stream 'v'"):
        view.append("v", torch.zeros(2, 3))
    kv.free(a)
    kv.free(b)


def test_a_fresh_sequence_beside_a_running_one_reads_zero_state():
    kv, storage = _setup()
    a, b = Request("a", list(range(20))), Request("b", list(range(20)))
    kv.match_prefix(a), kv.match_prefix(b)
    cache = _run(kv, storage, [a], [0], [5], [0])
    cache.layers[0]["s"] = torch.ones(1, 2, 2)
    storage.states[0, "s"][1] = 7.0  # what an earlier request left in slot 1
    cache = _run(kv, storage, [a, b], [5, 0], [1, 3], [0, 1])
    assert cache.meta.fresh == (False, True)
    assert torch.equal(cache.layers[0]["s"], torch.stack([torch.ones(2, 2), torch.zeros(2, 2)]))
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
