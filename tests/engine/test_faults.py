"""A failed engine step (dayzero/engine/faults.py injects them right after the step's forward, the hardest
moment to recover from): out of memory retries the step's requests within a smaller token budget and
gives the tokens of a run without faults; any other exception fails only the requests of that step
(finish_reason "error" naming it) and the engine goes on. Sync and async scheduling, a model with
recurrent state and prefix snapshots (the demo, DeepSeek-V4) and one without (gpt-oss)."""

from __future__ import annotations

import math

import pytest

from dayzero import settings
from dayzero.engine import SamplingParams
from dayzero.engine.faults import FaultInjector, InjectedFault, parse_plan
from dayzero.engine.llm import LLM
from tests.engine.test_llm import FAMILIES, _assert_pool_free, _prompts


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [[(c.token_ids, c.finish_reason, [lp.logprob for lp in c.logprobs or []]) for c in o.outputs] for o in outs]


def _same(got, want):
    """Same tokens and finish reasons; logprobs equal to float32 noise (a preempted request recomputes its
    prefix in other chunks)."""
    assert [[c[:2] for c in o] for o in got] == [[c[:2] for c in o] for o in want]
    for o, w in zip(got, want):
        for c, d in zip(o, w):
            assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(c[2], d[2]))


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory):
    return FAMILIES["gpt_oss"][0](tmp_path_factory.mktemp("gpt_oss"))


def _workload(vocab):
    shared = _prompts(vocab, [32], seed=5)[0]  # a shared prefix: prefix cache hits (and V4 state snapshots)
    prompts = [shared + p for p in _prompts(vocab, [3, 12], seed=6)] + _prompts(vocab, [20], seed=7)
    params = [SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True, logprobs=1) for i in range(len(prompts))]
    params[2] = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1, n=2)
    return prompts, params


@pytest.mark.parametrize("model,async_scheduling", [("demo", False), ("gpt_oss", False), ("gpt_oss", True)])
def test_out_of_memory_retries_in_a_smaller_budget_and_changes_no_token(model, async_scheduling, gpt_oss_path):
    path = None if model == "demo" else gpt_oss_path
    faulty = LLM(path, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    assert faulty.engine.async_scheduling == async_scheduling and faulty.runner.stateful == (model == "demo")
    prompts, params = _workload(faulty.vocab_size)
    want = _run(faulty, prompts, params)
    faulty.runner.faults = FaultInjector("oom@0,oom@1,oom@4")  # two in a row: the budget halves twice
    got = _run(faulty, prompts, params)  # (the prefix cache holds the first run's blocks: hits, V4 snapshots)
    _same(got, want)
    injected = len(faulty.runner.faults.injected)
    assert injected == 3 and faulty.engine.num_oom_retries == injected == faulty.engine.num_failed_steps
    assert faulty.scheduler.budget_cap is not None and faulty.scheduler.budget_cap < 32
    if model == "demo":  # recurrent state may have advanced in place: the step's requests were preempted
        assert faulty.scheduler.num_preemptions >= injected
    _assert_pool_free(faulty)
    faulty.runner.faults = None  # and the next call, at the lowered budget, is clean too
    _same(_run(faulty, prompts[:2], params[:2]), want[:2])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_exception_in_a_step_fails_only_that_steps_requests(async_scheduling, gpt_oss_path):
    llm = LLM(gpt_oss_path, max_num_seqs=2, async_scheduling=async_scheduling)
    prompts = _prompts(llm.vocab_size, [6, 9, 7], seed=1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    for i, p in enumerate(prompts):  # r2 waits: two running requests at most
        engine.add_request(f"r{i}", *engine.validate(p, params))
    llm.runner.faults = FaultInjector("error@2")
    tokens, finished = {}, {}
    while engine.has_unfinished():
        for u in engine.step():
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finished:
                finished[u.request_id] = (u.finish_reason, u.error)
                engine.pop_finished(u.request_id)
    assert llm.runner.faults.injected == [(2, "error")]
    for rid in ("r0", "r1"):  # both were in the failed step; what they had streamed is a prefix of the answer
        reason, error = finished[rid]
        assert reason == "error" and "InjectedFault: injected error fault at step attempt 2" in error, error
        assert tokens[rid] == want[int(rid[1])][:len(tokens[rid])] and len(tokens[rid]) < 6
    assert finished["r2"] == ("length", None) and tokens["r2"] == want[2]
    assert engine.num_failed_steps == 1 and engine.num_oom_retries == 0
    _assert_pool_free(llm)
    llm.runner.faults = None
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_out_of_memory_at_one_token_fails_the_request_after_two_more_tries(gpt_oss_path):
    llm = LLM(gpt_oss_path, max_num_batched_tokens=4)
    llm.runner.faults = FaultInjector("oom/1")  # every step: the budget halves to 1 token, then gives up
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.finish_reason == "error" and "OutOfMemoryError" in out.outputs[0].error
    # 4 -> 2 -> 1 token, twice more at 1 token (ONE_TOKEN_OOM_RETRIES), then failed
    assert llm.engine.num_oom_retries == 4 and llm.scheduler.token_budget == 1 and llm.engine.num_failed_steps == 5
    _assert_pool_free(llm)


def test_the_budget_comes_back_after_a_quiet_spell(gpt_oss_path):
    from dayzero.engine.scheduler import RELAX_STEPS

    llm = LLM(gpt_oss_path, max_num_batched_tokens=64)
    llm.scheduler.limit_budget(16)
    for _ in range(RELAX_STEPS):
        assert llm.scheduler.token_budget == 16
        llm.scheduler.schedule()  # (nothing to run: a step of no requests)
    assert llm.scheduler.budget_cap == 32 and llm.scheduler.token_budget == 32


def test_fault_plans_and_the_setting():
    assert parse_plan(" oom@3, error/50 ") == (("oom", "@", 3), ("error", "/", 50))
    for bad in ("boom@1", "oom@x", "error/0", "oom"):
        with pytest.raises(ValueError, match="is not KIND@N or KIND/N"):
            parse_plan(bad)
    with pytest.raises(ValueError, match="DAYZERO_INJECT_FAULTS"):
        settings.from_environ({"DAYZERO_INJECT_FAULTS": "oom@"})
    faults = FaultInjector("error/3")
    raised = []
    for _ in range(7):
        try:
            faults.check()
        except InjectedFault:
            raised.append(faults.attempts - 1)
    assert raised == [2, 5]
    with settings.override(inject_faults="oom@0"):
        llm = LLM(max_num_batched_tokens=64)
    assert llm.runner.faults.plan == (("oom", "@", 0),)
