"""The benchmark's metrics on hand-made timelines: TTFT, ITL, TPOT, E2E and the summary's throughputs."""

import pytest

from dayzero.bench.metrics import PeakMemory, RequestRecord, RunResult


def _records():
    # request 0: sent at 1.0, tokens at 1.5, 1.7, 2.0 (3 tokens); request 1: sent at 1.2, tokens at 1.4, 1.6
    a = RequestRecord(prompt_len=10, start=1.0, token_times=[1.5, 1.7, 2.0], output_len=3, end=2.0)
    b = RequestRecord(prompt_len=6, start=1.2, token_times=[1.4, 1.6], output_len=2, end=1.6)
    return a, b


def test_per_request_latencies():
    a, b = _records()
    assert a.ttft == pytest.approx(0.5) and b.ttft == pytest.approx(0.2)
    assert a.itl == pytest.approx([0.2, 0.3]) and b.itl == pytest.approx([0.2])
    assert a.tpot == pytest.approx((1.0 - 0.5) / 2)
    assert a.e2e == pytest.approx(1.0)
    assert RequestRecord(4, 0.0, [0.1], 1, 0.1).tpot is None  # one token: no time per output token


def test_summary_throughputs_are_tokens_over_duration_and_failures_are_left_out():
    a, b = _records()
    failed = RequestRecord(prompt_len=99, start=1.0, error="HTTP 503: full")
    s = RunResult(4, [a, b, failed], duration=1.25, peak_memory=PeakMemory(3 * 2**30, "test")).summary()
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503: full"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (16, 5)
    assert s["request_throughput"] == pytest.approx(2 / 1.25)
    assert s["output_throughput"] == pytest.approx(5 / 1.25)
    assert s["total_token_throughput"] == pytest.approx(21 / 1.25)
    assert s["concurrency"] == pytest.approx((1.0 + 0.4) / 1.25)
    assert s["mean_ttft_ms"] == pytest.approx(350) and s["median_ttft_ms"] == pytest.approx(350)
    assert s["mean_itl_ms"] == pytest.approx(700 / 3)
    assert s["p99_itl_ms"] == pytest.approx(300 - 0.02 * 100, rel=1e-6)  # numpy's linear interpolation
    assert s["median_tpot_ms"] == pytest.approx((250 + 200) / 2)
    assert s["peak_memory_bytes"] == 3 * 2**30


def test_no_tokens_give_none_not_zero():
    r = RequestRecord(prompt_len=3, start=0.0, token_times=[0.5], output_len=1, end=0.5)
    s = RunResult(None, [r], duration=0.5).summary()
    assert s["mean_itl_ms"] is None and s["p99_tpot_ms"] is None and s["peak_memory_bytes"] is None
    assert s["mean_ttft_ms"] == pytest.approx(500)


def test_peak_memory_on_cpu_is_the_process_max_rss():
    import numpy as np

    before = PeakMemory.read("cpu")
    block = np.ones(64 * 2**20 // 8)  # 64 MiB touched
    after = PeakMemory.read("cpu")
    assert after.kind == "process max RSS"
    assert after.bytes >= before.bytes and after.bytes > block.nbytes
