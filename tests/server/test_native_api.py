"""SGLang's native API over plain HTTP: /generate and the info, health and cache endpoints."""

from __future__ import annotations

import json

import httpx

from dayzero.engine import SamplingParams
from tests.server.conftest import wait_pool_free


def test_generate_text_ids_list_stream(url, offline):
    want = offline.generate(["The lighthouse keeper", "Hi"], SamplingParams(max_tokens=6, temperature=0.0))
    sp = {"max_new_tokens": 6, "temperature": 0}
    r = httpx.post(f"{url}/generate", json={"text": "The lighthouse keeper", "sampling_params": sp, "rid": "abc"},
                   timeout=30).json()
    assert r["text"] == want[0].text and r["output_ids"] == want[0].token_ids
    assert r["meta_info"]["id"] == "abc" and r["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    r = httpx.post(f"{url}/generate", json={"input_ids": want[0].prompt_token_ids, "sampling_params": sp}, timeout=30)
    assert r.json()["output_ids"] == want[0].token_ids
    r = httpx.post(f"{url}/generate", json={"text": ["The lighthouse keeper", "Hi"], "sampling_params": sp,
                                            "return_logprob": True}, timeout=30).json()
    assert [o["text"] for o in r] == [w.text for w in want]
    assert [lp[1] for lp in r[0]["meta_info"]["output_token_logprobs"]] == want[0].token_ids
    with httpx.stream("POST", f"{url}/generate", json={"text": "The lighthouse keeper", "sampling_params": sp,
                                                       "stream": True}, timeout=30) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[-1]["text"] == want[0].text  # cumulative, as SGLang streams it
    assert all(a["text"] == b["text"][:len(a["text"])] for a, b in zip(chunks, chunks[1:]))


def test_generate_sampling_options(url):
    sp = {"max_new_tokens": 5, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1,
          "presence_penalty": 0.5, "frequency_penalty": 0.2, "ignore_eos": True, "stop_token_ids": [5], "seed": 3}
    a = httpx.post(f"{url}/generate", json={"text": "x y z", "sampling_params": sp}, timeout=30).json()
    b = httpx.post(f"{url}/generate", json={"text": "x y z", "sampling_params": sp}, timeout=30).json()
    assert a["output_ids"] == b["output_ids"]


def test_info_health_metrics(url):
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
    server = wait_pool_free(url)
    assert server["num_running_reqs"] == 0 and server["num_queued_reqs"] == 0 and server["kv_pool"]["num_blocks"] > 0
    text = httpx.get(f"{url}/metrics").text
    for name in ("num_running_reqs", "num_queued_reqs", "kv_cache_usage", "prefix_cache_hit_rate",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total"):
        assert f"dayzero:{name}" in text, name


def test_generate_reports_cached_tokens_of_a_repeated_prompt(url):
    ids = list(range(40, 90))  # 50 tokens: three whole 16-token blocks can be reused
    sp = {"max_new_tokens": 2, "temperature": 0}
    httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=30)
    again = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=30).json()
    assert again["meta_info"]["cached_tokens"] == 48
