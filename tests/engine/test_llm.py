"""The offline API end to end: a batch of prompts of different lengths through the engine (scheduler,
runner, sampler) gives, greedily, the tokens transformers' generate gives on each prompt alone; also
with chunked prefill and with preemption; bad input is rejected before anything is scheduled."""

import numpy as np
import pytest
import torch

from dayzero.cache import BlockPool, KVCacheManager
from dayzero.cache.layout import CacheLayout, StreamSpec
from dayzero.cache.paged import PagedKVStorage, PagedStepCache
from dayzero.cache.step import SeqStep, build_step
from dayzero.engine import SamplingParams
from dayzero.engine.request import Request
from dayzero.engine.llm import LLM
from dayzero.verify import load_reference
from tests.budget import ci_cases
from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint, build_deepseek_v32_checkpoint
from tests.models.deepseek_v4_checkpoints import build_deepseek_v4_checkpoint
from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint
from tests.models.kimi_linear_checkpoints import build_kimi_linear_checkpoint

NEW_TOKENS = 6
# 16 prompt lengths per family, past its thresholds: gpt-oss window 8, V3.2 index_topk 8, V4 window 16
# / CSA ratio 4 / HCA ratio 128, Kimi Linear KDA chunk 64
SHORT = [3, 5, 7, 9, 12, 15, 18, 22, 26, 30, 35, 41, 47, 54, 60, 70]
FAMILIES = {
    "deepseek_v3": (build_deepseek_v3_checkpoint, SHORT),
    "deepseek_v32": (build_deepseek_v32_checkpoint, SHORT),
    "deepseek_v4": (build_deepseek_v4_checkpoint, [3, 9, 15, 17, 20, 33, 40, 64, 90, 127, 129, 140, 160, 200, 257, 270]),
    "gpt_oss": (build_gpt_oss_checkpoint, SHORT),
    "kimi_linear": (build_kimi_linear_checkpoint, [3, 8, 17, 30, 45, 60, 63, 64, 65, 70, 80, 96, 110, 128, 129, 150]),
}


def _prompts(vocab, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _reference_tokens(path, prompts):
    hf = load_reference(path, torch.float32, "cpu")
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    builder, lengths = FAMILIES[request.param]
    path = builder(tmp_path_factory.mktemp(request.param))
    llm = LLM(path, dtype="float32")
    prompts = _prompts(llm.vocab_size, lengths)
    return request.param, path, prompts, _reference_tokens(path, prompts)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _assert_pool_free(llm):
    """Every block of every cache group's pool is free and no request holds a state slot."""
    assert all(p.num_free == p.num_blocks for p in llm.scheduler.kv.pools)
    assert not llm.scheduler.kv.block_tables and not llm.runner.num_requests and not llm.engine.tracks


def test_a_batch_of_16_prompts_matches_transformers_alone(family):
    name, path, prompts, expected = family
    llm = LLM(path, dtype="float32")
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    _assert_pool_free(llm)


def test_chunked_prefill_and_preemption_give_the_same_tokens(family):
    name, path, prompts, expected = family
    # a 16-token budget splits every long prompt (DeepSeek-V4's up to 270 tokens: 42, so that chunks
    # also end inside a compressor window of 4); a pool of 4-token blocks that holds the longest
    # sequence alone forces preemptions while several run
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    budget = 42 if name == "deepseek_v4" else 16
    llm = LLM(path, dtype="float32", max_num_batched_tokens=budget, block_size=4, num_kv_blocks=-(-longest // 4) + 1)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.scheduler.num_preemptions > 0
    _assert_pool_free(llm)


@pytest.fixture(scope="module")
def demo_llm():
    return LLM()


def test_demo_model_text_chat_and_stream(demo_llm):
    out = demo_llm.generate("The lighthouse keeper", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.text == demo_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    chat = demo_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert chat.prompt_token_ids == demo_llm.apply_chat_template([{"role": "user", "content": "hi"}])
    streamed = "".join(demo_llm.stream("The lighthouse keeper", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    assert streamed == out.text
    _assert_pool_free(demo_llm)


def test_seeded_sampling_is_reproducible_and_n_completions(demo_llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    a = demo_llm.generate([[5, 6, 7]], params)[0]
    b = demo_llm.generate([[5, 6, 7], [9, 9]], params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_stop_strings_and_stop_token_ids(demo_llm):
    base = demo_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop_id = base.token_ids[3]
    out = demo_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1] and out.finish_reason == "stop"
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop.strip():
        out = demo_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
        assert out.finish_reason == "stop" and stop not in out.text and text.startswith(out.text)
    _assert_pool_free(demo_llm)


def test_detokenizing_costs_the_same_per_token_at_any_length(demo_llm):
    """The engine decodes only a few tokens per step (dayzero/engine/detokenizer.py): the tokens passed
    to the tokenizer per output token stay flat from 3 to 16 tokens (a whole decode per step would
    grow from 2 to 8.5 per token), and the text is the whole output's decode."""
    from tests.engine.test_detokenizer import CountingTokenizer

    tokenizer = demo_llm.engine.tokenizer
    demo_llm.engine.tokenizer = counting = CountingTokenizer(tokenizer)
    try:
        per_token = []
        for n in (3, 16):
            counting.calls.clear()
            out = demo_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
            per_token.append(sum(counting.calls) / n)
            assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    finally:
        demo_llm.engine.tokenizer = tokenizer
    assert per_token[1] <= 1.5 * per_token[0] + 2, per_token


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt 1 is empty"),
    ([1, 10**6], SamplingParams(), "token id 1000000 is outside the vocabulary"),
    ([1, 2], SamplingParams(max_tokens=10**7), "max_tokens 10000000 is too many: 2 prompt tokens leave room for 8190"),
    ([1] * 9000, SamplingParams(max_tokens=None), "prompt 1 is too long: 9000 tokens, and the model's context of 8192"),
    ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
])
def test_bad_input_is_rejected_before_anything_runs(demo_llm, prompt, params, message):
    good = [3, 4, 5]
    with pytest.raises(ValueError, match=message):
        demo_llm.generate([good, prompt], [SamplingParams(max_tokens=2), params])
    assert not demo_llm.scheduler.has_unfinished()  # the good request was not queued either
    _assert_pool_free(demo_llm)


def test_a_stream_abandoned_early_aborts_and_frees_its_blocks(demo_llm):
    stream = demo_llm.stream([5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(stream)
    stream.close()
    assert not demo_llm.scheduler.has_unfinished()
    _assert_pool_free(demo_llm)


def test_generate_cli_streams_the_demo(capsys):
    from dayzero.cli import main

    assert main(["generate", "--max-tokens", "4", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and len(out.strip()) > 0
    assert err.count("weights are random, so its text is noise by design") == 1
    assert main(["generate", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_the_readme_python_example_runs_as_written(demo_llm, monkeypatch, capsys):
    import dayzero.engine.llm
    from tests.readme import code_blocks

    monkeypatch.setattr(dayzero.engine.llm, "LLM", lambda *args, **kwargs: demo_llm)  # LLM() is the demo
    (example,) = code_blocks("python", "Generating")
    assert "LLM()" in example
    exec(compile(example, "README.md", "exec"), {})
    assert capsys.readouterr().out.count("\n") == 2
    _assert_pool_free(demo_llm)


def test_a_missing_model_path_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model path {tmp_path / 'nothing'} does not exist"):
        LLM(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(tmp_path)


def test_kv_pool_sized_from_a_memory_budget():
    llm = LLM(kv_cache_gib=0.01, max_num_seqs=4)  # the demo: a full group (compressed entries) and a window group
    storage = llm.runner.storage
    budget = 0.01 * 2**30
    assert storage.nbytes <= budget < storage.nbytes + storage.page_bytes[0]  # the full group takes what is left
    assert storage.num_blocks[1] == 4 * (-(-31 // 16) + 3) + 2048 // 16  # window 32: bounded by the requests
    with pytest.raises(ValueError, match="holds no block"):
        LLM(kv_cache_gib=1e-6)
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        LLM(mem_fraction=0.001)
    small = LLM(num_kv_blocks=4, block_size=4)  # 16 tokens
    with pytest.raises(ValueError, match="need 5 KV blocks, the pool has 4"):
        small.generate([[1, 2, 3]], SamplingParams(max_tokens=15))


def test_startup_phases_are_timed_and_logged(caplog):
    """Every step of LLM(...) is in a phase: the top-level phases add up to the total; the weights phase
    counts the bytes read, the KV pool its arenas; the one-line summary is logged at INFO."""
    from dayzero.demo import demo_checkpoint
    from dayzero.weights import Checkpoint

    with caplog.at_level("INFO", logger="dayzero.engine.llm"):
        llm = LLM(max_num_seqs=4, load_threads=2)
    timer = llm.startup
    assert [p.name for p in timer.phases] == ["locate", "config", "model", "checkpoint", "weights", "post_load",
                                              "tokenizer", "workspace", "engine"]
    assert [c.name for c in timer.get("engine").children] == ["cache_layout", "kv_pool"]
    assert timer.phase_seconds == pytest.approx(timer.total_seconds, rel=0.02, abs=0.02)
    assert all(p.seconds >= 0 for p in timer.phases)
    weights = timer.get("weights")
    assert weights.bytes == Checkpoint.open(demo_checkpoint()).total_bytes  # the demo ships no unused tensors
    assert weights.detail.endswith("2 thread(s), to cpu")
    assert timer.get("kv_pool").bytes == llm.runner.storage.nbytes
    assert [r.getMessage() for r in caplog.records if r.name == "dayzero.engine.llm"] == [timer.summary()]
    assert timer.as_dict()["phases"][4]["bytes"] == weights.bytes


PAGED = ["deepseek_v3", "deepseek_v32", "deepseek_v4", "gpt_oss", "kimi_linear"]


@pytest.mark.parametrize("name", PAGED)
def test_second_turn_reuses_the_first_and_computes_only_new_tokens(name, tmp_path):
    path = FAMILIES[name][0](tmp_path)
    warm = LLM(path, dtype="float32")  # prefix caching on (default), block_size 16
    cold = LLM(path, dtype="float32", enable_prefix_caching=False)
    first = _prompts(warm.vocab_size, [70], seed=1)[0]
    out1 = warm.generate([first], GREEDY)[0].token_ids
    assert out1 == cold.generate([first], GREEDY)[0].token_ids
    # turn 2: the whole first turn (prompt + answer) and a new user message
    second = first + out1 + _prompts(warm.vocab_size, [9], seed=2)[0]
    sched = warm.scheduler
    computed, cached = sched.num_computed_tokens_total, sched.num_prefix_cached_tokens
    out2 = warm.generate([second], GREEDY)[0].token_ids
    assert out2 == cold.generate([second], GREEDY)[0].token_ids
    # turn 1 computed 70 + 5 tokens (the last answer token is never an input): 4 full blocks of 16
    # hashed; states (KDA, V4 compressors) resume from the snapshot at the last block boundary
    # passed (64); sliding-window groups still hold the blocks of the window before it
    reused = sched.num_prefix_cached_tokens - cached
    assert reused == 64
    assert sched.num_computed_tokens_total - computed == len(second) - reused + NEW_TOKENS - 1
    if name in ("kimi_linear", "deepseek_v4"):  # KDA state / compressor windows resumed from a snapshot
        assert warm.runner.snapshots.restored == 1
    _assert_pool_free(warm)
    _assert_pool_free(cold)


def test_requests_that_share_a_prefix_mid_compression_window_keep_their_own_entries(tmp_path):
    """DeepSeek-V4 (HCA ratio 128, 16-token blocks): a cached 144-token prefix ends inside the window of
    entry 1 (tokens 128-255, its first token in the prefix's last shared block); two requests continue it
    with different 112-token prompts, side by side, each completing its own entry 1. The entry lives in
    the page of its last token (dayzero.ops.paged), not in the shared page of its first, so neither
    overwrites the other's: both get the tokens they get without prefix caching."""
    path = FAMILIES["deepseek_v4"][0](tmp_path)
    warm = LLM(path, dtype="float32")
    cold = LLM(path, dtype="float32", enable_prefix_caching=False)
    base = _prompts(warm.vocab_size, [144], seed=3)[0]
    prompts = [base + p for p in _prompts(warm.vocab_size, [112, 112], seed=4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    warm.generate([base + [1]], SamplingParams(max_tokens=1, temperature=0.0))
    together = warm.generate(prompts, params)
    assert warm.scheduler.num_prefix_cached_tokens >= 2 * 144  # both reused the prefix's full blocks
    for got, want in zip(together, [cold.generate([p], params)[0] for p in prompts]):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose([lp.logprob for lp in got.outputs[0].logprobs],
                                   [lp.logprob for lp in want.outputs[0].logprobs], rtol=1e-5, atol=1e-5)
    _assert_pool_free(warm)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_step_is_one_packed_forward(name, tmp_path):
    """Eight prompts of different lengths with a small token budget: steps mix decodes and prefill
    chunks, each step is one forward, and every request gets the tokens it gets alone."""
    path = FAMILIES[name][0](tmp_path)
    llm, alone = LLM(path, dtype="float32", max_num_batched_tokens=40), LLM(path, dtype="float32")
    prompts = _prompts(llm.vocab_size, [5, 9, 20, 33, 34, 35, 36, 37])
    schedule, steps = llm.scheduler.schedule, []

    def counting():
        out = schedule()
        steps.append((sum(s.num_new_tokens == 1 and s.num_computed_tokens > 0 for s in out.scheduled),
                      sum(s.num_new_tokens > 1 or s.num_computed_tokens == 0 for s in out.scheduled)))
        return out

    llm.scheduler.schedule = counting
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    busy = [s for s in steps if sum(s)]
    assert llm.runner.num_forwards == len(busy)
    assert any(d and p for d, p in busy)  # some steps decode and prefill together
    _assert_pool_free(llm)


def test_sliding_window_blocks_go_back_to_the_pool_while_generating(tmp_path):
    llm = LLM(build_gpt_oss_checkpoint(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=16)
    window = llm.runner.storage.layout.windows[1]
    engine, kv = llm.engine, llm.scheduler.kv
    ids, params = engine.validate(_prompts(llm.vocab_size, [40])[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("r", ids, params)
    most_full = 0
    while engine.has_unfinished():
        engine.step()
        if "r" in kv.block_tables:  # after every step only the blocks of the last window - 1 tokens stay
            assert len(kv.held_blocks("r", 1)) <= -(-(window - 1) // 4) + 1
            most_full = max(most_full, len(kv.held_blocks("r", 0)))
    assert most_full == -(-(40 + 19) // 4)  # the full-attention group keeps every block
    engine.pop_finished("r")
    _assert_pool_free(llm)


@pytest.mark.parametrize("name", ["deepseek_v32", "gpt_oss", "kimi_linear"])
def test_fp8_kv_cache_equals_the_model_on_fp8_rounded_keys(name, tmp_path):
    path = FAMILIES[name][0](tmp_path)
    exact, fp8 = LLM(path, dtype="float32"), LLM(path, dtype="float32", kv_cache_dtype="fp8_e4m3")
    assert fp8.runner.storage.page_bytes[0] < exact.runner.storage.page_bytes[0] / 2.5  # 1 B + scales vs 4 B
    prompts = _prompts(exact.vocab_size, [5, 30, 41])
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    model = fp8.model
    for prompt, out in zip(prompts, fp8.generate(prompts, params)):
        cache = model.new_cache(1, kv_cache_dtype="fp8_e4m3")  # its own paged FP8 cache, unbatched
        ids = prompt + out.token_ids
        with torch.no_grad():  # prefill, then one token at a time, as the engine ran it
            logits = [model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)[0, -1]]
            for i in range(len(prompt), len(ids) - 1):
                logits.append(model(torch.tensor([[ids[i]]]), torch.tensor([[i]]), cache)[0, -1])
        for lp, step in zip(out.outputs[0].logprobs, logits):
            assert lp.token_id == int(step.argmax())
            assert abs(lp.logprob - float(torch.log_softmax(step, -1)[lp.token_id])) < 1e-4
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4' is not supported"):
        LLM(path, dtype="float32", kv_cache_dtype="fp4")
    _assert_pool_free(fp8)


def test_fp8_kv_stream_round_trip_matches_torch_float8():
    kv = KVCacheManager([BlockPool(8)], 4, enable_prefix_caching=False)
    layout = CacheLayout([StreamSpec(0, "k", (2, 200), torch.float32, None)], []).with_kv_cache_dtype("fp8_e4m3")
    storage = PagedKVStorage(layout, [8], 4, 1, 0, "cpu")
    req = Request("a", list(range(6)))
    kv.match_prefix(req)
    assert kv.allocate_slots(req, 6)
    meta = build_step([SeqStep(0, 6, kv.block_tables["a"])], layout, 4, "cpu")
    x = torch.randn(6, 2, 200) * torch.logspace(-3, 3, 200)
    got = PagedStepCache(storage, meta, 1).layers[0].append("k", x).gather(0, 0, 6)
    # independently: per 128 values scale = amax / 448, torch's own float8 rounding
    groups = [x[..., :128], x[..., 128:]]
    want = torch.cat([(g / (g.abs().amax(-1, keepdim=True) / 448)).to(torch.float8_e4m3fn).float()
                      * (g.abs().amax(-1, keepdim=True) / 448) for g in groups], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    kv.free(req)


def test_sparse_decode_reads_only_the_selected_latents_through_the_page_table(tmp_path, monkeypatch):
    from dayzero.ops.paged import PagedStream

    llm = LLM(build_deepseek_v32_checkpoint(tmp_path), dtype="float32")
    topk = llm.model.config["index_topk"]
    read = []
    original = PagedStream.read

    def counting(self, pages, offsets):
        latents = {t.data_ptr() for (_, name), t in llm.runner.storage.streams.items() if name == "kv_latent"}
        if self.data.data_ptr() in latents:
            read.append(pages.numel())
        return original(self, pages, offsets)

    monkeypatch.setattr(PagedStream, "read", counting)
    prompts = _prompts(llm.vocab_size, [30, 41, 47])
    llm.generate(prompts, GREEDY)
    # every forward is sparse (more keys than index_topk): each query reads its topk latents through
    # the page table (a prefill topk per query, a decode step topk per row), never a whole context
    assert read and all(n % topk == 0 for n in read)
    assert read[-1] == topk and max(read) <= 47 * topk


def test_the_fp8_expert_workspace_is_reserved_where_path_b_can_run():
    """LLM asks the kernel library for its workspace bytes (kernels.moe.workspace_bytes): none where the
    kernels never run path B (here: CPU), so nothing is taken from the KV budget; where they can (forced
    here), one workspace of every expert a step can activate, handed to each MoE layer with its weights
    and subtracted from a mem_fraction budget."""
    from dayzero import settings
    from dayzero.engine.llm import _kv_budget_from_fraction
    from dayzero.kernels.moe import expert_slot_bytes

    llm = LLM(kv_cache_gib=0.01)  # the demo: MXFP4 experts
    assert llm.expert_workspace is None
    takers = [m for m in llm.model.modules() if hasattr(type(m), "fp8_workspace")]
    assert takers and all(m.fp8_workspace is None for m in takers)
    with pytest.raises(ValueError, match="never run path B"):
        LLM(kv_cache_gib=0.01, fp8_workspace_gib=1.0)
    with settings.override(variants={"moe_experts_mxfp4": "fp8"}):
        forced = LLM(kv_cache_gib=0.01)
        e = forced.model.spec.experts
        ws = forced.expert_workspace
        assert ws is not None and ws.capacity_bytes == e.num * expert_slot_bytes(e.intermediate_size, e.input_dim)
        assert all(m.fp8_workspace is ws for m in forced.model.modules() if hasattr(type(m), "fp8_workspace"))
        assert LLM(kv_cache_gib=0.01, fp8_workspace_gib=0).expert_workspace is None  # 0: no workspace
        from dataclasses import replace

        from dayzero.engine.workspace import attach_expert_workspace

        model = forced.model
        model.parallel = replace(model.parallel, ep_size=2, ep_rank=1)  # a rank holding half of the experts
        try:
            half = attach_expert_workspace(model, None, 8192)
        finally:
            model.parallel = replace(model.parallel, ep_size=1, ep_rank=0)
        assert half.capacity_bytes == e.num // 2 * expert_slot_bytes(e.intermediate_size, e.input_dim)
    full = _kv_budget_from_fraction(forced.model, 0.9, 0)
    assert _kv_budget_from_fraction(forced.model, 0.9, ws.capacity_bytes) == full - ws.capacity_bytes


@pytest.mark.parametrize("tokens,chunk,bound_gib", ci_cases([(8192, 2048, 0.5), (16384, 4096, 1.0)]))
def test_a_long_prompt_keeps_peak_memory_bounded(tmp_path, tokens, chunk, bound_gib):
    """A long prompt on the CPU with a tiny gpt-oss: chunked prefill and the references' query chunks keep
    attention scores O(tokens x chunk). Measured in a fresh process (peak resident set): one unchunked causal
    score matrix of the prompt alone would take tokens^2 x 4 heads x 4 B, 1 GiB at 8K, 4 GiB at 16K. CI runs
    the 8K prompt in 2K chunks (the same chunked prefill and query chunks, a quarter of the time); the 16K
    prompt in 4K chunks runs with DAYZERO_FULL_TESTS=1."""
    import subprocess
    import sys

    path = build_gpt_oss_checkpoint(tmp_path, max_position_embeddings=32768)
    script = f"""
import resource, torch
from dayzero import LLM, SamplingParams
llm = LLM({str(path)!r}, dtype="float32", max_model_len={tokens + 116}, max_num_batched_tokens={chunk})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = torch.randint(0, llm.vocab_size, ({tokens},), generator=torch.Generator().manual_seed(0)).tolist()
out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert len(out.token_ids) == 2
print((after - before) / 2**20)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    growth_gib = float(run.stdout.strip().splitlines()[-1])
    print(f"peak resident set growth over a {tokens}-token prompt: {growth_gib:.2f} GiB")
    assert growth_gib < bound_gib
