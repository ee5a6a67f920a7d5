"""Decode steps over fixed buffers with padding (dayzero.engine.graphs, dayzero.cache.static_step).

On the CPU, `DecodeGraphs(capture=False)` runs the padded static step eagerly: every family's greedy
tokens and per-step logprobs must equal the ordinary packed step's, with batch sizes that fall
between buckets (padding sequences present) and the pool fully free afterwards. On CUDA the same
comparison runs with captured graphs (skipped without a device)."""

import numpy as np
import pytest
import torch

from dayzero.cache.layout import CacheLayout, StreamSpec
from dayzero.cache.static_step import StaticStep
from dayzero.cache.step import SeqStep, build_step
from dayzero.engine import SamplingParams
from dayzero.engine.graphs import DecodeGraphs, graph_buckets
from dayzero.engine.llm import LLM
from tests.engine.test_llm import FAMILIES, _assert_pool_free, _prompts
from tests.models.glm4_moe_checkpoints import build_glm4_moe_checkpoint
from tests.models.kimi_k3_checkpoints import build_kimi_k3_checkpoint
from tests.models.qwen3_5_moe_checkpoints import build_qwen3_5_moe_checkpoint

CASES = {**{k: v[0] for k, v in FAMILIES.items()}, "kimi_k3": build_kimi_k3_checkpoint,
         "qwen3_5_moe": build_qwen3_5_moe_checkpoint}
CUDA_CASES = {**CASES, "glm4_moe": build_glm4_moe_checkpoint}  # on the CPU GLM's static step is gpt-oss's GQA path
PARAMS = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2)


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(16) == [1, 2, 4, 8, 16]
    assert graph_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    for n in range(1, 70):
        b = graph_buckets(n)
        assert b[-1] == n and b == sorted(set(b))
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_buckets(0)


LAYOUT = CacheLayout([StreamSpec(0, "k", (2, 4), torch.float32, None, 1),
                      StreamSpec(0, "kw", (2, 4), torch.float32, 8, 1)], [])


def test_the_static_step_holds_what_build_step_builds_and_pads_with_scratch():
    rng = np.random.default_rng(0)
    bs, max_blocks, scratch = 4, 6, [40, 41]
    static = StaticStep(LAYOUT, bs, 8, bs * max_blocks, scratch, 9, "cpu")
    for trial in range(5):
        n = int(rng.integers(1, 8))
        steps = []
        for i in range(n):
            start = int(rng.integers(1, bs * max_blocks))
            full = rng.permutation(40)[:start // bs + 1].tolist()
            window = [None] * max(0, start // bs - 2) + full[max(0, start // bs - 2):]
            steps.append(SeqStep(start, 1, [full, window], int(rng.integers(0, 8)), True, [int(rng.integers(0, 99))]))
        ref = build_step(steps, LAYOUT, bs, "cpu")
        b = min(x for x in graph_buckets(8) if x >= n)
        static.fill(steps, b)
        got = static.meta(b, tuple(s.start + 1 for s in steps) + (1,) * (b - n))
        assert got.input_ids[:n].tolist() == ref.input_ids.tolist()
        assert got.positions[:n].tolist() == ref.positions.tolist()
        assert got.seqs.query_start.tolist() == list(range(b + 1))
        assert got.seqs.seq_lens[:n].tolist() == ref.seqs.seq_lens.tolist()
        assert got.state_slots[:n].tolist() == ref.state_slots.tolist()
        for g in (0, 1):
            for i, s in enumerate(steps):
                width = len(s.tables[g])
                assert got.block_tables[g][i, :width].tolist() == ref.block_tables[g][i, :width].tolist()
            pages, offsets = got.writes[g, 1]
            assert pages[:n].tolist() == ref.writes[g, 1][0].tolist()
            assert offsets[:n].tolist() == ref.writes[g, 1][1].tolist()
            # padding: one token at position 0, written to and read from the scratch page only
            assert pages[n:].tolist() == [scratch[g]] * (b - n) and offsets[n:].tolist() == [0] * (b - n)
            assert got.block_tables[g][n:, 0].tolist() == [scratch[g]] * (b - n)
        assert got.seqs.seq_lens[n:].tolist() == [1] * (b - n)
        assert got.state_slots[n:].tolist() == [9] * (b - n)
        assert got.logits_indices.tolist() == list(range(b))


def test_the_static_step_writes_only_new_table_tails_and_stays_right():
    """Across steps: tables grow in place, window entries are reclaimed (None), requests leave and
    others take their rows, the batch shrinks to padding and grows again. Every live page of every
    row and every write location must be build_step's."""
    rng = np.random.default_rng(1)
    bs, static = 4, StaticStep(LAYOUT, 4, 8, 4 * 30, [90, 91], 9, "cpu")
    live, next_page = {}, 0  # request -> [start, full table, window table]

    def admit(rid):
        nonlocal next_page
        start = int(rng.integers(1, 20))
        pages = list(range(next_page, next_page + start // bs + 1))
        next_page += len(pages)
        live[rid] = [start, pages, list(pages)]

    for rid in range(5):
        admit(rid)
    for step in range(40):
        if rng.random() < 0.2 and live:
            live.pop(int(rng.choice(list(live))))
        if rng.random() < 0.3 and len(live) < 8:
            admit(100 + step)
        steps = []
        for rid, entry in live.items():
            entry[0] += 1
            start, full, window = entry
            while len(full) <= start // bs:
                full.append(next_page)
                window.append(next_page)
                next_page += 1
            for j in range(max(0, start // bs - 2)):
                window[j] = None  # reclaimed out of the window
            steps.append(SeqStep(start, 1, [full, window], rid % 8, True, [rid]))
        if not steps:
            continue
        b = min(x for x in graph_buckets(8) if x >= len(steps))
        static.fill(steps, b)
        got = static.meta(b, tuple(s.start + 1 for s in steps) + (1,) * (b - len(steps)))
        ref = build_step(steps, LAYOUT, bs, "cpu")
        for g in (0, 1):
            for i, s in enumerate(steps):
                for j, p in enumerate(s.tables[g]):
                    if p is not None:
                        assert int(got.block_tables[g][i, j]) == p, (step, g, i, j)
            assert got.writes[g, 1][0][:len(steps)].tolist() == ref.writes[g, 1][0].tolist()


def test_host_tables_convert_incrementally_and_equal_the_full_conversion():
    """build_step with the runner's HostTables gives exactly the arrays of converting every table
    afresh, across growing tables, window reclaim from the front, tables leaving and returning."""
    from collections import defaultdict

    from dayzero.cache.step import HostTables

    rng = np.random.default_rng(2)
    host = defaultdict(HostTables)
    live, next_page = {}, 0
    for step in range(60):
        if rng.random() < 0.3 or not live:
            start = int(rng.integers(1, 30))
            pages = list(range(next_page, next_page + start // 4 + 1))
            next_page += len(pages)
            live[step] = [start, pages, [None] * (len(pages) // 2) + pages[len(pages) // 2:]]
        if rng.random() < 0.15 and len(live) > 1:
            live.pop(int(rng.choice(list(live))))
        steps = []
        for rid, entry in live.items():
            if rng.random() < 0.2:
                continue  # not scheduled this step
            entry[0] += int(rng.integers(1, 9))
            start, full, window = entry
            while len(full) <= start // 4:
                full.append(next_page)
                window.append(next_page)
                next_page += 1
            for j in range(max(0, start // 4 - 2)):
                window[j] = None
            steps.append(SeqStep(start - 1, 1, [full, window], 0, True, [1]))
        if not steps:
            continue
        got, want = build_step(steps, LAYOUT, 4, "cpu", host), build_step(steps, LAYOUT, 4, "cpu")
        for g in (0, 1):
            assert torch.equal(got.block_tables[g], want.block_tables[g]), (step, g)


def test_the_static_step_refuses_what_a_graph_cannot_run():
    static = StaticStep(LAYOUT, 4, 4, 12, [9, 9], 0, "cpu")
    assert static.meta(2).seqs.seq_lens_host == (12, 12)  # kernels plan for the longest sequence
    with pytest.raises(ValueError, match="exactly one given token"):
        static.fill([SeqStep(3, 2, [[0, 1], [0, 1]], 0, True, [1, 2])], 2)
    with pytest.raises(ValueError, match="exceeds"):
        static.fill([SeqStep(3, 1, [[0, 1, 2, 3], [0, 1, 2, 3]], 0, True, [1])], 1)
    with pytest.raises(ValueError, match="batch of"):
        static.fill([SeqStep(3, 1, [[0], [0]], 0, True, [1])] * 3, 2)


@pytest.mark.parametrize("rate", [2, 4, 8, 16])
def test_the_static_step_gives_each_row_a_candidate_slot_for_compressed_streams(rate):
    """Streams of compressed entries (rates below, at and above the block size): a row whose token
    completes its window gets the slot build_step writes that entry to, the others and the padding the
    scratch page; the rate-1 writes stay build_step's."""
    rng = np.random.default_rng(rate)
    layout = CacheLayout([StreamSpec(0, "kw", (4,), torch.float32, 8, 1), StreamSpec(0, "c", (4,), torch.float32, None, rate)], [])
    bs, scratch = 4, [50, 51]
    static = StaticStep(layout, bs, 8, bs * 12, scratch, 9, "cpu")
    kinds = {r: g for g, r, _ in layout.stream_kinds(bs)}
    for trial in range(12):
        n = int(rng.integers(1, 8))
        starts = [int(rng.integers(1, bs * 11)) for _ in range(n)]
        if trial % 3 == 0:
            starts = [(int(rng.integers(1, 40 // rate + 1)) * rate - 1) for _ in range(n)]  # every window completes
        tables = [[rng.permutation(50)[:s // bs + 1].tolist() for _ in range(2)] for s in starts]
        steps = [SeqStep(s, 1, t, 0, True, [1]) for s, t in zip(starts, tables)]
        ref = build_step(steps, layout, bs, "cpu")
        b = min(x for x in graph_buckets(8) if x >= n)
        static.fill(steps, b)
        got = static.meta(b, tuple(x + 1 for x in starts) + (1,) * (b - n))
        g = kinds[rate]
        pages, offsets = got.candidates[g, rate]
        completes = [(x + 1) % rate == 0 for x in starts]
        want_pages, want_offsets = ref.writes[g, rate]
        assert pages[:n][torch.tensor(completes)].tolist() == want_pages.tolist()  # sequence order, one each
        assert offsets[:n][torch.tensor(completes)].tolist() == want_offsets.tolist()
        assert [p for p, c in zip(pages[:n].tolist(), completes) if not c] == [scratch[g]] * (n - sum(completes))
        assert pages[n:].tolist() == [scratch[g]] * (b - n)
        g1 = kinds[1]
        assert got.writes[g1, 1][0][:n].tolist() == ref.writes[g1, 1][0].tolist()


def _run(llm, prompts):
    outs = llm.generate(prompts, PARAMS)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_padded_static_decode_gives_the_packed_steps_tokens_and_logprobs(name, tmp_path):
    path = CASES[name](tmp_path)
    kwargs = dict(dtype="float32", max_num_seqs=6, max_model_len=128)
    eager, static = LLM(path, **kwargs), LLM(path, **kwargs)
    engine = static.engine
    assert static.runner.graphs is None  # no graphs on the CPU unless asked for
    static.runner.graphs = DecodeGraphs(static.model, engine.runner.storage, engine.scheduler.kv.block_size, 6,
                                        static.max_model_len, capture=False)
    prompts = _prompts(eager.vocab_size, [3, 17, 9, 30, 5])  # 5 sequences: bucket 6 with one padding row
    tokens, logprobs = _run(eager, prompts)
    got_tokens, got_logprobs = _run(static, prompts)
    assert got_tokens == tokens
    np.testing.assert_allclose(got_logprobs, logprobs, rtol=1e-5, atol=1e-5)
    assert static.runner.num_graph_steps >= PARAMS.max_tokens - 2
    _assert_pool_free(static)
    # a second, smaller batch through a smaller bucket, after the first left its pages behind
    got, ref = _run(static, prompts[:3]), _run(eager, prompts[:3])
    assert got[0] == ref[0]
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)
    _assert_pool_free(static)


def test_v4_padded_static_decode_writes_each_rows_candidate_entry_fp8_cache_too(tmp_path):
    """DeepSeek-V4 with an FP8 cache: a prompt of 126 tokens decodes through its HCA window's end (token
    127: the candidate becomes entry 0, written to its slot, the other rows' to the scratch page) and
    CSA's, in padded static steps; tokens equal the packed steps', logprobs within 2e-3: the padded and packed
    steps run matmuls of different row counts, whose last-bit differences can flip an e4m3 rounding (a 1/16
    step) and move a logprob by 4e-4 (measured on the H200 on CUDA, 2026-12-04, and on the H100 host's CPU,
    2026-12-06: 2 of 35 values, tokens equal), where a candidate entry written to the wrong slot moves them
    by far more. On the CPU; the CUDA graph tests compare replays with eager steps of the same rows."""
    path = FAMILIES["deepseek_v4"][0](tmp_path)
    kwargs = dict(dtype="float32", device="cpu", max_num_seqs=6, max_model_len=160, kv_cache_dtype="fp8_e4m3")
    eager, static = LLM(path, **kwargs), LLM(path, **kwargs)
    engine = static.engine
    static.runner.graphs = DecodeGraphs(static.model, engine.runner.storage, engine.scheduler.kv.block_size, 6,
                                        static.max_model_len, capture=False)
    prompts = _prompts(eager.vocab_size, [3, 17, 9, 126, 5])
    tokens, logprobs = _run(eager, prompts)
    got_tokens, got_logprobs = _run(static, prompts)
    assert got_tokens == tokens and static.runner.num_graph_steps >= PARAMS.max_tokens - 2
    np.testing.assert_allclose(got_logprobs, logprobs, rtol=0, atol=2e-3)
    _assert_pool_free(static)


def test_models_say_whether_their_decode_step_captures(tmp_path):
    v4 = LLM(FAMILIES["deepseek_v4"][0](tmp_path), dtype="float32")
    assert v4.model.cuda_graph_blocker(1 << 20) is None  # decodes read the paged streams in place
    v32 = LLM(FAMILIES["deepseek_v32"][0](tmp_path), dtype="float32")
    assert v32.model.cuda_graph_blocker(1 << 17) is None  # DSA's kernels capture past index_topk
    gpt_oss = LLM(FAMILIES["gpt_oss"][0](tmp_path), dtype="float32")
    assert gpt_oss.model.cuda_graph_blocker(1 << 20) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check_every_graph_step_against_eager(llm, rel_tol):
    """Wrap the graphs' run: after each replay, run the same step eagerly (build_step + forward; it
    rewrites the same cache entries, from the recurrent state the replay started from) and record the
    logits' relative error. Returns the errors."""
    from dayzero.cache.paged import PagedStepCache

    graphs, storage, errors = llm.runner.graphs, llm.runner.storage, []
    replay = graphs.run

    def both(steps, patch=None):
        before = {k: t.clone() for k, t in storage.states.items()}  # the step advances recurrent state:
        got = replay(steps, patch).clone()
        for k, t in storage.states.items():  # the eager rerun starts from the same state as the replay
            t.copy_(before[k])
        meta = build_step(steps, storage.layout, llm.scheduler.kv.block_size, llm.model.device_)
        if patch is not None:
            patch(meta.input_ids)
        ref = llm.model.forward_packed(meta.input_ids, meta.positions,
                                       PagedStepCache(storage, meta, llm.model.spec.num_layers))
        errors.append(((got - ref).norm() / ref.norm()).item())
        assert errors[-1] < rel_tol, (len(steps), errors)
        return got

    graphs.run = both
    return errors


@pytest.mark.parametrize("name", ["gpt_oss", "kimi_linear"])
def test_the_step_by_step_check_holds_on_the_cpu_recurrent_state_included(name, tmp_path):
    """The harness of the CUDA tests, on the CPU's padded static step: each step's logits equal the
    same step rerun eagerly from the same state (KDA's recurrent state restored in between)."""
    llm = LLM(CASES[name](tmp_path), dtype="float32", max_num_seqs=6, max_model_len=128)
    engine = llm.engine
    llm.runner.graphs = DecodeGraphs(llm.model, engine.runner.storage, engine.scheduler.kv.block_size, 6,
                                     llm.max_model_len, capture=False)
    errors = _check_every_graph_step_against_eager(llm, 1e-5)
    llm.generate(_prompts(llm.vocab_size, [3, 17, 9, 30, 5]), SamplingParams(max_tokens=5, temperature=0.0,
                                                                             ignore_eos=True))
    assert len(errors) >= 3
    _assert_pool_free(llm)


# the tiny checkpoints whose every decode op has a kernel that captures (bf16); the Kimi ones' experts
# run the reference MoE op (their tiny shapes or activation are not the kernels'), so capture falls back
MUST_CAPTURE = {"deepseek_v3", "deepseek_v32", "gpt_oss"}


@cuda
@pytest.mark.parametrize("name", sorted(CUDA_CASES))
def test_every_graph_replay_gives_the_eager_steps_logits_on_cuda(name, tmp_path, caplog):
    """bf16: each decode step's logits from the graph against the same step run eagerly right after;
    batches of 5 (bucket 6, one padding row) then 3 (bucket 4). A model whose capture fails runs
    eagerly and the log says why."""
    path = CUDA_CASES[name](tmp_path)
    kwargs = dict(dtype="bfloat16", device="cuda", max_num_seqs=6, max_model_len=128)  # DSA: past index_topk 8
    with caplog.at_level("INFO", logger="dayzero"):
        llm = LLM(path, **kwargs)
    if llm.runner.graphs is None:
        assert name not in MUST_CAPTURE and "without CUDA graphs" in caplog.text, caplog.text
        return
    errors = _check_every_graph_step_against_eager(llm, 2e-2)
    lengths = [3, 17, 9, 30, 5]  # DSA: replays take the sparse path; eager steps, dense MLA while <= index_topk
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    for prompts in (_prompts(llm.vocab_size, lengths), _prompts(llm.vocab_size, lengths[:3], seed=1)):
        llm.generate(prompts, params)
    assert len(errors) == llm.runner.graphs.num_replays >= 2
    _assert_pool_free(llm)


@cuda
def test_graph_replays_give_the_eager_steps_tokens_and_uncapturable_steps_run_eagerly(tmp_path, caplog):
    """bf16 gpt-oss: greedy tokens of 10 requests with graphs on and off (the replays' split counts
    GEMMs run at the bucket's row count, so bf16 sums may round apart: nearly all sequences agree) and each
    replay's logits against the same step eagerly; float32 gpt-oss (its experts run the reference
    MoE op, which checks ids on the host) runs eagerly, saying why."""
    path = FAMILIES["gpt_oss"][0](tmp_path)
    kwargs = dict(dtype="bfloat16", device="cuda", max_num_seqs=16, max_model_len=256)  # one KV split, as eager
    eager, graphs = LLM(path, cuda_graphs=False, **kwargs), LLM(path, **kwargs)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    prompts = _prompts(eager.vocab_size, [3, 17, 9, 30, 5, 40, 12, 8, 20, 11])
    errors = _check_every_graph_step_against_eager(graphs, 2e-2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert sum(x == y for x, y in zip(got, want)) >= 8, (got, want)  # a near-tie may flip one sequence's tail
    assert graphs.runner.num_graph_steps >= 10 and len(errors) == graphs.runner.num_graph_steps
    _assert_pool_free(graphs)
    with caplog.at_level("INFO", logger="dayzero"):
        f32 = LLM(path, dtype="float32", device="cuda")
    assert f32.runner.graphs is None and "capturing batch" in caplog.text
    assert [o.token_ids for o in f32.generate(prompts[:2], params)] == [
        o.token_ids for o in LLM(path, dtype="float32", device="cuda", cuda_graphs=False).generate(prompts[:2], params)]


@cuda
def test_an_engine_with_graphs_gives_back_its_device_memory_when_collected():
    """Engines built and dropped one after another in a process (a notebook, `dayzero bench --vs
    transformers`): the second leaves no more memory allocated than the first did. Graph warm-ups once ran
    on a new stream per graph, and torch keeps a 32 MiB cuBLAS workspace per stream for the process's life:
    160 MiB kept per demo engine (H100, 2026-12-06)."""
    import gc

    def build_and_drop() -> int:
        llm = LLM(None, device="cuda", dtype="bfloat16", max_num_seqs=8)
        assert llm.runner.graphs is not None and len(llm.runner.graphs.graphs) > 1
        llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        del llm
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    first = build_and_drop()
    assert build_and_drop() == first
