"""Faults under the server: an exception inside an engine step answers 500 naming it to the requests of
that step only (a stream already answering gets an error event, then data: [DONE]) and the server goes
on serving (/health turns 503 only while every step fails); out of memory in steps retries them and every request still gets its 200; a full queue is a
503 with Retry-After; a request that could never fit is a 400 naming n."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from dayzero.engine.engine import UNHEALTHY_AFTER_FAILED_STEPS
from dayzero.engine.faults import FaultInjector
from tests.server.conftest import start_server, stop_server, wait_pool_free


@pytest.fixture(scope="module")
def one_at_a_time():
    """A server that runs one request at a time (the next waits in the queue, out of the running step)."""
    running = start_server(max_running_requests=1, max_queued_requests=3)
    yield running
    stop_server(running)


def _runner(running):
    return running.app.state.async_engine.engine.runner


def test_a_failed_step_fails_its_request_with_a_500_and_the_server_goes_on(one_at_a_time, offline):
    url, runner = one_at_a_time.url, _runner(one_at_a_time)
    runner.faults = FaultInjector("error@0")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "internal_error" and err["type"] == "server_error", r.text
    assert "the engine step running this request failed: InjectedFault: injected error fault" in err["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    runner.faults = FaultInjector("error/1")  # a broken device: every step fails, and /health says so
    for _ in range(UNHEALTHY_AFTER_FAILED_STEPS):
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60).status_code == 500
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 503 and "engine steps failed" in r.json()["error"]["message"], r.text
    runner.faults = None
    want = offline.generate(["Hello"], _greedy(4))[0].text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # a step succeeded: healthy again
    wait_pool_free(url)


def _greedy(n):
    from dayzero.engine import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_a_stream_in_a_failed_step_ends_with_an_error_event_and_the_queued_request_is_untouched(one_at_a_time, offline):
    url, runner = one_at_a_time.url, _runner(one_at_a_time)
    want = offline.generate(["The lighthouse keeper"], _greedy(6))[0].text

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as s:
                assert s.status_code == 200
                lines = s.aiter_lines()
                first = await anext(lines)
                # a second request queues behind it (one running at a time), then the next step fails
                queued = asyncio.ensure_future(client.post("/v1/completions", json={
                    "prompt": "The lighthouse keeper", "max_tokens": 6, "temperature": 0, "ignore_eos": True}))
                while one_at_a_time.app.state.async_engine.num_in_flight < 2:
                    await asyncio.sleep(0.01)
                runner.faults = FaultInjector("error@1")
                rest = [line async for line in lines]
            return [first, *rest], await queued

    lines, queued = asyncio.run(main())
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["code"] == "internal_error" and "InjectedFault" in err["message"], data[-3:]
    assert all("error" not in json.loads(d) for d in data[:-2])  # the tokens before it came through
    assert queued.status_code == 200 and queued.json()["choices"][0]["text"] == want, queued.text
    assert runner.faults.injected == [(1, "error")]
    wait_pool_free(url)


def test_out_of_memory_steps_are_retried_and_every_request_gets_its_answer(offline):
    running = start_server(max_running_requests=4, llm_kwargs={"max_num_batched_tokens": 64})
    try:
        url = running.url
        prompts = ["The lighthouse keeper " * k for k in (1, 5, 9, 3, 12, 2)]
        want = [o.text for o in offline.generate(prompts, _greedy(5))]
        _runner(running).faults = FaultInjector("oom@0,oom@1,oom@6")
        async_engine, gate = running.app.state.async_engine, threading.Event()

        async def burst():
            held = asyncio.ensure_future(async_engine.call(lambda e: gate.wait(60)))  # the engine waits for all
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                posts = asyncio.gather(*[client.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True}) for p in prompts])
                while async_engine.num_in_flight < len(prompts):
                    await asyncio.sleep(0.01)
                gate.set()
                await held
                return await posts

        answers = asyncio.run(burst())
        assert [r.status_code for r in answers] == [200] * len(prompts)
        assert [r.json()["choices"][0]["text"] for r in answers] == want
        info = wait_pool_free(url)
        assert info["num_oom_retries"] == 3 == info["num_failed_steps"] and info["token_budget"] < 64
        assert info["num_tracked_reqs"] == 0 == info["num_state_slots_held"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'dayzero:num_oom_retries{model_name="demo"} 3' in metrics
    finally:
        stop_server(running)


def test_a_full_queue_is_a_503_with_retry_after_and_too_many_sequences_a_400(one_at_a_time):
    url = one_at_a_time.url
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 5}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n" and "holds at most 4 at once" in err["message"], r.text
    r = httpx.post(f"{url}/generate", json={"text": ["a", "b", "c", "d", "e"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"prompt": "Hello", "max_tokens": 12, "ignore_eos": True}
            return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(8)])

    answers = asyncio.run(burst())
    full = [r for r in answers if r.status_code == 503]
    assert full and {r.status_code for r in answers} == {200, 503}
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in full)
    wait_pool_free(url)
