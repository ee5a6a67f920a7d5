"""Load: 132 requests at concurrency 64 (4x the server's 16 running requests, so most queue), mixed
streaming, non-streaming, early disconnects and invalid ones. Every valid request completes
correctly, every invalid one gets its 4xx, the server stays up, and afterwards the KV pool is fully
free. DAYZERO_FULL_TESTS=1 runs the long version: 520 requests."""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx

from tests.server.conftest import start_server, stop_server, wait_pool_free

NUM_REQUESTS = 520 if os.environ.get("DAYZERO_FULL_TESTS") == "1" else 132  # a multiple of the 6 kinds
CONCURRENCY = 64


async def _one(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    kind = ("complete", "stream", "generate", "chat", "disconnect", "invalid")[i % 6]
    max_tokens = rng.randint(1, 6)
    prompt = " ".join(rng.choice(["sea", "light", "keeper", "stone", "wind", "7"]) for _ in range(rng.randint(1, 12)))
    if kind == "complete":
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens
    elif kind == "chat":
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                            "max_tokens": max_tokens, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    elif kind == "generate":
        r = await client.post("/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": max_tokens, "ignore_eos": True}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == max_tokens, r.text
    elif kind == "stream":
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            lines = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["usage"]["completion_tokens"] == max_tokens
    elif kind == "disconnect":  # long request, dropped after the first chunk
        body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            async for line in s.aiter_lines():
                if line.startswith("data: "):
                    break
    else:
        bad = rng.choice([{"prompt": prompt, "max_tokens": -3}, {"prompt": prompt, "temperature": "x"},
                          {"prompt": "", "max_tokens": 2}, {"prompt": prompt, "unknown_field": 1}])
        r = await client.post("/v1/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"], r.text
    return kind


def _run_load(url: str, num_requests: int) -> list[str]:
    async def main():
        rng = random.Random(0)
        sem = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            async def bounded(i):
                async with sem:
                    return await _one(client, i, rng)

            return await asyncio.gather(*[bounded(i) for i in range(num_requests)])

    return asyncio.run(main())


def test_load_with_async_scheduling():
    """The same mix (fewer requests) against a server whose engine schedules each step before the
    last step's ids arrive: every request completes, disconnects abort, the pool ends free."""
    running = start_server(llm_kwargs={"async_scheduling": True, "enable_prefix_caching": False})
    try:
        engine = running.app.state.async_engine.engine
        assert engine.async_scheduling
        assert len(_run_load(running.url, 36)) == 36
        assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200
        wait_pool_free(running.url)
        assert engine.num_overlapped_steps > 0
    finally:
        stop_server(running)


def test_load(url):
    kinds = _run_load(url, NUM_REQUESTS)
    assert len(kinds) == NUM_REQUESTS
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    info = wait_pool_free(url)
    assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'finish_reason="abort"' in metrics  # the disconnected streams were aborted
