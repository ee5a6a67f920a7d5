"""bench/soak.py's short version, in-process (the CI soak): a few seconds of the whole mix (streams and
not, chat / completions / /generate, n = 2, long prompts over a small KV pool, shared prefixes, stops,
clients hanging up, streams cut) with out-of-memory steps injected, then a burst of arrivals past the
in-flight limit. The soak's checks pass (no failed or lost request, memory and pool without a trend, the
pool free and nothing tracked at the end), the burst gets only 200s and early 503s with Retry-After, and
the server logs no error (a client hanging up on a plain request used to log an InvalidStateError
traceback). The goodput curve (0.5x to 3x the measured capacity) is bench/soak.py's, over longer runs."""

from __future__ import annotations

import asyncio
import logging
import os

from bench import soak
from dayzero.engine.faults import FaultInjector
from tests.server.conftest import start_server, stop_server

SECONDS = 60 if os.environ.get("DAYZERO_FULL_TESTS") == "1" else 5


def _rss_mib() -> float:
    return soak.rss_mib(os.getpid())


def test_the_short_soak_and_overload_pass_every_check(caplog):
    running = start_server(max_running_requests=4, max_queued_requests=4, llm_kwargs={"num_kv_blocks": 200})
    try:
        engine = running.app.state.async_engine.engine
        assert engine.scheduler.kv.pool.num_blocks == 200  # long prompts fill it: preemption
        engine.runner.faults = FaultInjector("oom@10,oom@11,oom@60")  # (the budget relaxes every 64 steps)
        # (2 cores: a lighter mix; a stream cut first: how many requests 5 s hold depends on the machine)
        traffic = soak.Traffic(seed=0, long_prompt=(100, 300), max_tokens=(2, 6), first=("stream_cut", "long_prompt"))
        with caplog.at_level(logging.WARNING):
            result = asyncio.run(soak.soak(running.url, SECONDS, workers=4, rss=_rss_mib, interval=0.5, traffic=traffic))
            burst = asyncio.run(soak.offered(running.url, rate=20, duration=1.5))  # ~30 arrivals, 8 in flight at most
        print(soak.report(result, None), burst)
        counts = result.counts()
        assert counts["ok"] >= 10 and counts["cut"] >= 1, counts
        for name, (ok, why) in result.checks().items():
            assert ok, f"{name}: {why}"
        assert burst["other"] == 0 and burst["ok"] >= 8 and burst["rejected"] >= 10, burst  # only 200s and 503s
        assert burst["retry_after"] == ["1"] and burst["reject_p99_s"] < 1.0, burst  # rejected at once, Retry-After
        # the soak's last /get_server_info saw its retries; a later injected fault may land in the burst
        assert 1 <= result.final["num_oom_retries"] <= engine.num_oom_retries
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors[0].getMessage()
    finally:
        stop_server(running)
