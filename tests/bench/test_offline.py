"""The offline runner on the demo model: the concurrency limit holds, every token is timed, the
engine is left empty, and the greedy tokens are the ones LLM.generate gives."""

import pytest

from dayzero.bench.offline import run_offline
from dayzero.bench.workload import Workload
from dayzero.engine import SamplingParams
from dayzero.engine.llm import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, max_model_len=32)


def _max_in_flight(records) -> int:
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, change in events:
        now += change
        most = max(most, now)
    return most


@pytest.mark.parametrize("limit", [1, 2, None])
def test_the_concurrency_limit_holds_and_every_token_is_timed(llm, limit):
    w = Workload(num_prompts=5, input_len=6, output_len=3, vocab_size=llm.vocab_size, range_ratio=0.5, seed=limit or 0)
    requests = w.requests()
    run = run_offline(llm.engine, requests, limit)
    assert _max_in_flight(run.records) == (limit or 5)  # unlimited: all 5 sent at once (the engine runs 4, queues 1)
    for r, req in zip(run.records, requests):
        assert r.ok and r.output_len == req.output_len == len(r.token_times)
        assert r.prompt_len == len(req.prompt_token_ids)
        assert r.start <= r.token_times[0] <= r.end == r.token_times[-1]
        assert len(r.itl) == req.output_len - 1 and all(x >= 0 for x in r.itl)
    s = run.summary()
    assert s["total_output_tokens"] == sum(req.output_len for req in requests)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / run.duration)
    assert run.duration == pytest.approx(max(r.end for r in run.records) - min(r.start for r in run.records), abs=0.05)
    assert not llm.engine.has_unfinished() and not llm.engine.tracks
    assert all(p.num_free == p.num_blocks for p in llm.scheduler.kv.pools)


def _recorded(llm, requests, limit, prefix):
    """({request id: the tokens its updates carried}, the run) of run_offline."""
    tokens = {}
    step = llm.engine.step

    def recording_step():
        updates = step()
        for u in updates:
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
        return updates

    llm.engine.step = recording_step
    try:
        run = run_offline(llm.engine, requests, limit, prefix=prefix)
    finally:
        del llm.engine.step
    return tokens, run


def test_the_benchmark_generates_what_generate_gives(llm):
    """The runner drives the same engine as LLM.generate: greedy, the same tokens per prompt."""
    requests = Workload(num_prompts=3, input_len=5, output_len=4, vocab_size=llm.vocab_size, seed=7).requests()
    expected = [o.token_ids for o in llm.generate([r.prompt_token_ids for r in requests],
                                                  SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]
    tokens, _ = _recorded(llm, requests, 2, "check")
    assert [tokens[f"check-{i}"] for i in range(3)] == expected


def test_a_workload_the_model_cannot_hold_fails_before_anything_runs(llm):
    requests = Workload(num_prompts=2, input_len=40, output_len=4, vocab_size=llm.vocab_size).requests()
    with pytest.raises(ValueError, match="prompt 0 is too long"):
        run_offline(llm.engine, requests, None)
    assert not llm.engine.has_unfinished()


def test_a_json_schema_workload_is_constrained(llm):
    """--json-schema: every request samples under the schema's mask (RECORDS_SCHEMA never completes, so
    all output tokens are constrained: the text is a prefix of an array of records)."""
    from dayzero.bench.workload import RECORDS_SCHEMA

    w = Workload(num_prompts=2, input_len=4, output_len=8, vocab_size=llm.vocab_size, json_schema=RECORDS_SCHEMA)
    tokens, run = _recorded(llm, w.requests(), None, "json")
    assert all(r.ok and r.output_len == 8 for r in run.records)
    for ids in tokens.values():
        assert llm.tokenizer.decode(ids).startswith('[{"id":')
    assert w.to_dict()["json_schema"] == RECORDS_SCHEMA
