"""Scheduler: FCFS under the token budget and max_num_seqs, chunked prefill, prefix reuse, preemption
by recompute, abort, stop checks, and a randomized simulation with a tiny pool. Every test ends with
every block back in the pool."""

import random

import pytest

from dayzero.cache import BlockPool, KVCacheManager
from dayzero.engine import SamplingParams
from dayzero.engine.request import Request, RequestStatus
from dayzero.engine.scheduler import Scheduler


def _scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, chunked_prefill=True,
               enable_prefix_caching=True, eos_token_ids=None) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size, enable_prefix_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, chunked_prefill, eos_token_ids)


def _request(rid, prompt, max_tokens=4, **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))


def _check_invariants(s: Scheduler):
    pool, kv = s.kv.pool, s.kv
    holders = [0] * pool.num_blocks
    for rid in kv.block_tables:
        for b in kv.held_blocks(rid):
            holders[b] += 1
    assert holders == pool.ref_count  # every reference is a block-table entry
    assert len(s.running) <= s.max_num_seqs
    for r in s.running:
        assert r.status is RequestStatus.RUNNING
        assert len(kv.block_table(r.request_id)) >= kv.num_blocks_for(r.num_computed_tokens)
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and not kv.block_table(r.request_id)


def _assert_no_leaks(s: Scheduler):
    _check_invariants(s)
    assert not s.has_unfinished() and not s.running and not s.waiting
    assert s.kv.pool.num_free == s.kv.pool.num_blocks and not s.kv.block_tables


def _step(s: Scheduler, sample=lambda req: 7):
    """One fake step: the 'runner' samples for each request whose step reached its last token."""
    out = s.schedule()
    assert out.num_batched_tokens <= s.max_num_batched_tokens and len(out.scheduled) <= s.max_num_seqs
    for sr in out.scheduled:  # the block table covers every position this step writes
        assert len(s.kv.block_table(sr.request.request_id)) * s.kv.block_size >= sr.num_computed_tokens + sr.num_new_tokens
    s.update(out, {sr.request.request_id: sample(sr.request) if sr.samples else None for sr in out.scheduled})
    _check_invariants(s)
    return out


def _run(s: Scheduler, sample=lambda req: 7, max_steps=10_000):
    outputs = []
    while s.has_unfinished():
        outputs.append(_step(s, sample))
        assert len(outputs) < max_steps, "the scheduler made no progress"
    return outputs


def test_fcfs_under_the_token_budget_without_chunking():
    s = _scheduler(max_num_batched_tokens=10, chunked_prefill=False)
    reqs = [_request(n, range(i * 10, i * 10 + 6)) for i, n in enumerate("abc")]
    for r in reqs:
        s.add(r)
    assert _step(s).num_scheduled_tokens == {"a": 6}  # b's 6 do not fit in the 4 left, and c waits behind b
    assert _step(s).num_scheduled_tokens == {"a": 1, "b": 6}
    assert _step(s).num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}
    _run(s)
    assert all(len(r.output_token_ids) == 4 and r.finish_reason == "length" for r in reqs)
    _assert_no_leaks(s)


def test_fcfs_with_chunked_prefill_fills_the_budget():
    s = _scheduler(max_num_batched_tokens=10)
    for i, n in enumerate("abc"):
        s.add(_request(n, range(i * 10, i * 10 + 6)))
    first = _step(s)
    assert first.num_scheduled_tokens == {"a": 6, "b": 4}
    assert [sr.samples for sr in first.scheduled] == [True, False]
    assert _step(s).num_scheduled_tokens == {"a": 1, "b": 2, "c": 6}
    _run(s)
    _assert_no_leaks(s)


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks():
    s = _scheduler(max_num_batched_tokens=8)
    r = _request("long", range(30), max_tokens=3)
    s.add(r)
    outputs = _run(s)
    assert [o.num_scheduled_tokens["long"] for o in outputs] == [8, 8, 8, 6, 1, 1]
    assert [o.scheduled[0].samples for o in outputs] == [False, False, False, True, True, True]
    assert s.num_computed_tokens_total == 30 + 2  # the prompt once, then each output but the last
    assert len(r.output_token_ids) == 3
    _assert_no_leaks(s)


def test_max_num_seqs_is_respected():
    s = _scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [_request(f"r{i}", range(i * 10, i * 10 + 5), max_tokens=3) for i in range(5)]
    for r in reqs:
        s.add(r)
    outputs = _run(s)
    assert max(len(o.scheduled) for o in outputs) == 2
    assert [sorted(o.num_scheduled_tokens) for o in outputs[:3]] == [["r0", "r1"]] * 3  # r2 waits for a slot
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    _assert_no_leaks(s)


def test_a_shared_prefix_is_computed_once():
    s = _scheduler(block_size=4)
    prompt = list(range(100, 120))  # 5 full blocks
    s.add(_request("first", prompt, max_tokens=2))
    _run(s)
    assert s.num_computed_tokens_total == 20 + 1 and s.num_prefix_cached_tokens == 0

    second = _request("second", prompt[:16] + [1, 2, 3, 4, 5], max_tokens=2)  # shares 4 blocks
    s.add(second)
    first_step = _step(s)
    assert first_step.num_scheduled_tokens == {"second": 5} and first_step.scheduled[0].num_computed_tokens == 16
    _run(s)
    assert second.num_cached_tokens == 16 and s.num_prefix_cached_tokens == 16
    assert s.num_computed_tokens_total == 21 + 5 + 1

    same = _request("same", prompt, max_tokens=1)  # the whole prompt is cached: its last block is recomputed
    s.add(same)
    _run(s)
    assert same.num_cached_tokens == 16 and s.num_computed_tokens_total == 27 + 4
    _assert_no_leaks(s)


def test_prefix_caching_off_computes_everything():
    s = _scheduler(enable_prefix_caching=False)
    for n in "ab":
        s.add(_request(n, range(20), max_tokens=1))
        _run(s)
    assert s.num_prefix_cached_tokens == 0 and s.num_computed_tokens_total == 40
    _assert_no_leaks(s)


def test_preemption_recomputes_the_latest_arrival_and_it_still_finishes():
    # 6 blocks of 4 tokens; each request alone needs ceil((8 + 12 - 1) / 4) = 5, together 10.
    s = _scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a = _request("a", range(8), max_tokens=12)
    b = _request("b", range(50, 58), max_tokens=12)
    s.add(a)
    s.add(b)
    outputs = []
    while not s.num_preemptions:
        outputs.append(_step(s))
    assert outputs[-1].preempted == ["b"] and list(s.waiting) == [b]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    kept = list(b.output_token_ids)
    assert kept  # its outputs are kept and recomputed with the prompt
    outputs = _run(s)
    resume = next(o for o in outputs if "b" in o.num_scheduled_tokens)
    assert resume.num_scheduled_tokens["b"] == 8 + len(kept) and resume.scheduled[-1].samples
    assert b.output_token_ids[:len(kept)] == kept
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 12
    assert a.finish_reason == b.finish_reason == "length"
    _assert_no_leaks(s)


def test_preempted_request_goes_first_when_blocks_come_back():
    s = _scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    a, b, c = (_request(n, range(i * 100, i * 100 + 8), max_tokens=12) for i, n in enumerate("abc"))
    for r in (a, b, c):
        s.add(r)
    admitted_after_preemption = []
    while s.has_unfinished():
        out = _step(s)
        if s.num_preemptions:
            admitted_after_preemption += [sr.request.request_id for sr in out.scheduled
                                          if sr.num_computed_tokens == 0]
    assert s.num_preemptions >= 1
    assert admitted_after_preemption.index("b") < admitted_after_preemption.index("c")
    assert all(len(r.output_token_ids) == 12 for r in (a, b, c))
    _assert_no_leaks(s)


def test_abort_frees_blocks_at_once():
    s = _scheduler(num_blocks=16, max_num_batched_tokens=8)
    running = _request("running", range(20))
    waiting = _request("waiting", range(30, 40))
    s.add(running)
    s.add(waiting)
    _step(s)  # running has a first chunk, waiting is queued
    assert s.kv.pool.num_free < 16
    assert s.abort("waiting") is waiting and waiting.finish_reason == "abort"
    out = s.schedule()
    assert s.abort("running") is running and running.status is RequestStatus.FINISHED_ABORTED
    assert s.kv.pool.num_free == 16  # at once, not at the next step
    s.update(out, {})  # the step that was in flight when it was aborted is ignored for it
    assert s.abort("running") is None and s.abort("never-added") is None
    _assert_no_leaks(s)


def test_stop_on_eos_and_stop_token_ids():
    s = _scheduler(eos_token_ids=[0])
    eos = Request("eos", [5, 6], SamplingParams(max_tokens=10))
    stop = Request("stop", [5, 7], SamplingParams(max_tokens=10, stop_token_ids=[3]))
    ignored = Request("ignored", [5, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    for r in (eos, stop, ignored):
        s.add(r)
    script = {"eos": [9, 0], "stop": [9, 9, 3], "ignored": [0, 0, 0, 0]}
    _run(s, sample=lambda r: script[r.request_id][len(r.output_token_ids)])
    assert eos.output_token_ids == [9, 0] and eos.finish_reason == "stop" and eos.stop_reason is None
    assert stop.output_token_ids == [9, 9, 3] and stop.stop_reason == 3
    assert ignored.output_token_ids == [0] * 4 and ignored.finish_reason == "length"
    _assert_no_leaks(s)


def test_stop_string_hook_finishes_a_running_request():
    s = _scheduler()
    r = _request("r", range(4), max_tokens=10)
    s.add(r)
    _step(s)
    s.finish(r, RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")  # what the detokenizer calls
    assert r.finish_reason == "stop" and r.stop_reason == "\n\n"
    _assert_no_leaks(s)


def test_add_rejects_requests_that_cannot_run():
    s = _scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8, chunked_prefill=False)
    with pytest.raises(ValueError, match="needs 5 KV blocks of 4 tokens .* the pool has 4"):
        s.add(_request("too-long", range(17), max_tokens=1))
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        s.add(_request("grows-too-long", range(8), max_tokens=10))
    with pytest.raises(ValueError, match="enable chunked prefill or raise max_num_batched_tokens"):
        s.add(_request("over-budget", range(9), max_tokens=1))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(_request("empty", []))
    s.add(_request("ok", range(4)))
    with pytest.raises(ValueError, match="already queued"):
        s.add(_request("ok", range(4)))
    _run(s)
    _assert_no_leaks(s)


def test_unbounded_request_stops_when_the_pool_is_full():
    s = _scheduler(num_blocks=2, block_size=4)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=None, ignore_eos=True))
    s.add(r)
    _run(s)
    assert r.finish_reason == "length" and r.num_tokens == 2 * 4 + 1  # 8 KV entries + the last sampled token
    _assert_no_leaks(s)


@pytest.mark.parametrize("seed", range(6))
def test_randomized_simulation_with_a_tiny_pool(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    chunked = rng.random() < 0.7
    s = _scheduler(num_blocks=rng.randint(60, 80) // block_size, block_size=block_size,
                   max_num_seqs=rng.randint(1, 6),
                   max_num_batched_tokens=rng.randint(4, 32) if chunked else 40,
                   chunked_prefill=chunked, enable_prefix_caching=rng.random() < 0.8, eos_token_ids=[0])
    shared = [rng.randrange(1000) for _ in range(24)]
    pending = []
    for i in range(60):
        prompt = shared[:rng.randint(0, 24)] + [rng.randrange(1000) for _ in range(rng.randint(1, 16))]
        pending.append(_request(f"r{i}", prompt[:40], max_tokens=rng.randint(1, 20)))
    added, aborted = [], set()
    steps = 0
    while pending or s.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                s.add(pending.pop(0))
                added.append(s.requests[f"r{len(added)}"])
        if s.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(s.requests))
            s.abort(victim)
            aborted.add(victim)
        _step(s, sample=lambda r: rng.randrange(20))  # EOS (0) is drawn often and must be ignored
        steps += 1
        assert steps < 20_000
    assert len(added) == 60
    for r in added:
        if r.request_id in aborted:
            assert r.finish_reason == "abort"
        else:
            assert r.finish_reason == "length" and len(r.output_token_ids) == r.sampling_params.max_tokens
    _assert_no_leaks(s)
