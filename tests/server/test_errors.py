"""Bad requests answer 4xx with an OpenAI-style error body naming the field; API key; full queue."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.conftest import start_server, stop_server, wait_pool_free

OK = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = [
    ("/v1/completions", {**OK, "temperature": -1}, "temperature"),
    ("/v1/completions", {**OK, "top_p": 0}, "top_p"),
    ("/v1/completions", {**OK, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**OK, "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {**OK, "n": 0}, "n"),
    ("/v1/completions", {**OK, "n": True}, "n"),
    ("/v1/completions", {**OK, "seed": 1.5}, "seed"),
    ("/v1/completions", {**OK, "stop": [""]}, "stop"),
    ("/v1/completions", {**OK, "logprobs": 9}, "logprobs"),
    ("/v1/completions", {**OK, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {**OK, "bogus": 1}, "bogus"),
    ("/v1/completions", {**OK, "model": "gpt-4"}, "model"),
    ("/v1/completions", {**OK, "echo": True}, "echo"),
    ("/v1/completions", {**OK, "prompt": ""}, "prompt"),
    ("/v1/completions", {**OK, "prompt": []}, "prompt"),
    ("/v1/completions", {**OK, "prompt": [10**9]}, "prompt"),
    ("/v1/completions", {**OK, "prompt": "word " * 9000}, "prompt"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools.0"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, "text"),
    ("/generate", {"text": "a", "input_ids": [1]}, "text"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "top_k": -5}}, "top_k"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "min_p": 2}}, "min_p"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "colour": 1}}, "sampling_params.colour"),
    ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ("/generate", {"input_ids": [-1], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ("/generate", {"text": "a", "sampling_params": {"stop_token_ids": [10**9]}}, "stop_token_ids"),
]


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{p}:{prm}" for p, _, prm in CASES])
def test_bad_request(url, path, body, param):
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"] and err["type"]


def test_an_unknown_model_is_a_404_naming_the_served_one(url):
    r = httpx.post(f"{url}/v1/completions", json={**OK, "model": "gpt-oss-20b"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found"
    assert "'gpt-oss-20b' does not exist; this server serves 'demo'" in err["message"]


def test_too_long_prompts_and_too_many_tokens_name_the_numbers(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 9000}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "prompt is too long: 9000 tokens" in err["message"] and "8192" in err["message"]
    assert "SamplingParams" not in err["message"] and "max_tokens" not in err["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 9000}]}, timeout=30)
    assert r.json()["error"]["param"] == "messages" and "messages is too long" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 100, "max_tokens": 8100}, timeout=30)
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "leave room for 8092" in err["message"]
    r = httpx.post(f"{url}/v1/completions", json={**OK, "temperature": -1}, timeout=30)
    assert "SamplingParams" not in r.json()["error"]["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_body(url, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"]


def test_api_key_and_full_queue():
    running = start_server(api_key="sekret", max_running_requests=1, max_queued_requests=1)
    try:
        url, auth = running.url, {"Authorization": "Bearer sekret"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(f"{url}/v1/completions", json=OK, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=OK, headers=auth, timeout=30).status_code == 200

        async def burst():
            async with httpx.AsyncClient(base_url=url, headers=auth, timeout=60) as client:
                body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(6)])

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes.count(200) >= 2 and set(codes) <= {200, 503} and 503 in codes, codes
        wait_pool_free(url, auth)
    finally:
        stop_server(running)
