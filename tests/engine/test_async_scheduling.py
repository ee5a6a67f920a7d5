"""Async scheduling (Engine._step_async): each step is scheduled and launched before the last step's
sampled ids reach the host. Whatever the requests do (finish at max_tokens, on a stop id, on a stop
string, abort, get chunked or preempted, sample n > 1, use penalties), the outputs must be the
synchronous engine's, token for token, and the pool must end free."""

import pytest

from dayzero.engine import SamplingParams
from dayzero.engine.llm import LLM
from dayzero.engine.request import PENDING, Request
from tests.engine.test_llm import FAMILIES, _assert_pool_free, _prompts


def test_pending_tokens_count_but_read_as_pending():
    req = Request("r", [5, 6, 7])
    req.output_token_ids.append(8)
    req.num_pending = 2
    assert (req.num_tokens, req.num_known_tokens, req.num_output_tokens) == (6, 4, 3)
    assert req.token_ids(2, 6) == [7, 8, PENDING, PENDING]
    assert req.token_ids(0, 3) == [5, 6, 7] and req.token_ids(4, 5) == [PENDING]


def _outputs(llm, prompts, params):
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
            for o in llm.generate(prompts, params)]


def _workload(llm, lengths, seed=0):
    prompts = _prompts(llm.vocab_size, lengths, seed)
    params = [SamplingParams(max_tokens=3 + (i % 5) * 2, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=9, temperature=0.8, seed=3, n=2, ignore_eos=True)  # seeded sampling, n=2
    return prompts, params


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3", "kimi_linear"])
def test_async_scheduling_gives_the_synchronous_outputs(name, tmp_path):
    path = FAMILIES[name][0](tmp_path)
    kwargs = dict(dtype="float32", max_num_batched_tokens=24, enable_prefix_caching=False)
    sync, overlap = LLM(path, **kwargs), LLM(path, async_scheduling=True, **kwargs)
    assert overlap.engine.async_scheduling
    prompts, params = _workload(sync, [3, 17, 9, 30, 5, 12])
    want = _outputs(sync, prompts, params)
    # a stop id met mid-way: request 0 stops at its third token, request 4 at its second
    params[0] = SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[want[0][0][0][2]])
    params[4] = SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[want[4][0][0][1]])
    want = _outputs(sync, prompts, params)
    assert [w[0][1] for w in want][0] == "stop" and len(want[0][0][0]) == 3
    assert _outputs(overlap, prompts, params) == want
    assert overlap.engine.num_overlapped_steps > 5
    _assert_pool_free(overlap)


def test_async_scheduling_under_preemption_and_chunking(tmp_path):
    path = FAMILIES["gpt_oss"][0](tmp_path)
    kwargs = dict(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=10, block_size=4,
                  enable_prefix_caching=True, max_model_len=40)
    sync, overlap = LLM(path, **kwargs), LLM(path, async_scheduling=True, **kwargs)
    prompts = _prompts(sync.vocab_size, [7, 5, 9, 6, 8])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = _outputs(sync, prompts, params)
    assert sync.scheduler.num_preemptions > 0
    assert _outputs(overlap, prompts, params) == want
    assert overlap.scheduler.num_preemptions > 0 and overlap.engine.num_overlapped_steps > 0
    _assert_pool_free(overlap)
    # a second turn reuses the first turn's cached blocks under async scheduling too (a pool that keeps them)
    sync, overlap = (LLM(path, dtype="float32", async_scheduling=a) for a in (False, True))
    first = _outputs(overlap, prompts[2:3], params)
    assert first == _outputs(sync, prompts[2:3], params)
    second = [prompts[2] + first[0][0][0] + [1, 2]]
    assert _outputs(overlap, second, params) == _outputs(sync, second, params)
    assert overlap.scheduler.num_prefix_cached_tokens == sync.scheduler.num_prefix_cached_tokens > 0
    _assert_pool_free(overlap)


def test_stop_strings_streams_aborts_and_penalties_on_the_demo():
    # the demo (DeepSeek-V4) keeps compressor state: without prefix caching there are no snapshots
    sync, overlap = LLM(enable_prefix_caching=False), LLM(enable_prefix_caching=False, async_scheduling=True)
    assert overlap.engine.async_scheduling
    text = sync.generate(["The lighthouse keeper"], SamplingParams(max_tokens=24, temperature=0.0))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # a stop string met mid-way
    params = [SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]),
              SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=11)]
    prompts = ["The lighthouse keeper", "A quiet harbour", "Once"]
    want = _outputs(sync, prompts, params)
    assert want[0][0][1] == "stop" and want[0][0][2] == stop
    assert _outputs(overlap, prompts, params) == want
    assert overlap.engine.num_overlapped_steps > 10  # penalties too: their counts live on the device
    # a stream abandoned after two pieces aborts its request; the next call is unaffected
    stream = overlap.stream("The lighthouse keeper", SamplingParams(max_tokens=30, temperature=0.0))
    next(stream), next(stream)
    stream.close()
    _assert_pool_free(overlap)
    assert _outputs(overlap, prompts[:1], params[:1]) == want[:1]
    _assert_pool_free(overlap)


def test_async_scheduling_stays_off_where_snapshots_key_on_the_ids(tmp_path, caplog):
    with caplog.at_level("INFO", logger="dayzero"):
        llm = LLM(FAMILIES["kimi_linear"][0](tmp_path), dtype="float32", async_scheduling=True)
    assert not llm.engine.async_scheduling and "async scheduling is off" in caplog.text


def test_every_request_finishes_once_with_its_tokens(tmp_path):
    """Driving the engine step by step: one finished update per request, its tokens streamed in order
    (max_tokens reached with two tokens in flight, a stop id met while the next is in flight)."""
    llm = LLM(FAMILIES["gpt_oss"][0](tmp_path), dtype="float32", async_scheduling=True)
    sync = LLM(FAMILIES["gpt_oss"][0](tmp_path), dtype="float32")
    engine = llm.engine
    prompts = _prompts(llm.vocab_size, [4, 6, 9, 3])
    first = sync.generate(prompts[2:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (1, 2, 8, 5)]
    params[2] = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first[3]])
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", *engine.validate(p, sp))
    streamed, finishes = {}, {}
    while engine.has_unfinished():
        for u in engine.step():
            streamed.setdefault(u.request_id, []).extend(u.new_token_ids)
            finishes[u.request_id] = finishes.get(u.request_id, 0) + u.finished
    assert finishes == {f"r{i}": 1 for i in range(4)}
    want = [o.token_ids for o in sync.generate(prompts, params)]
    assert [streamed[f"r{i}"] for i in range(4)] == want and len(want[2]) == 4
    for i in range(4):
        assert engine.pop_finished(f"r{i}").request.output_token_ids == want[i]
    _assert_pool_free(llm)


def test_an_abort_while_the_last_token_is_in_flight(tmp_path):
    """A request that reached max_tokens (its last token still on the way) and is then aborted: no
    finish update for it, nothing breaks, the others finish, the pool ends free."""
    llm = LLM(FAMILIES["gpt_oss"][0](tmp_path), dtype="float32", async_scheduling=True)
    engine = llm.engine
    prompts = _prompts(llm.vocab_size, [4, 6])
    engine.add_request("short", *engine.validate(prompts[0], SamplingParams(max_tokens=2, temperature=0.0,
                                                                              ignore_eos=True)))
    engine.add_request("long", *engine.validate(prompts[1], SamplingParams(max_tokens=6, temperature=0.0,
                                                                             ignore_eos=True)))
    seen, aborted = [], False
    while engine.has_unfinished():
        updates = engine.step()
        seen += [u.request_id for u in updates if u.finished]
        req = engine.tracks["short"].request if "short" in engine.tracks else None
        if req is not None and req.is_finished and req.num_pending:
            assert engine.abort("short") is False  # already finished in the scheduler: nothing to cancel
            aborted = True
    assert aborted and "short" not in seen and "long" in seen and engine.pop_finished("long").request.num_output_tokens == 6
    _assert_pool_free(llm)
