"""The HTTP runner: the same workload sent to a running OpenAI-compatible server (`dayzero serve`,
vLLM, SGLang) as streaming /v1/completions requests of token ids, at most `max_concurrency` in flight
(one worker thread per slot; the standard library only).

Each request asks for greedy decoding, max_tokens = its output length, ignore_eos (a vLLM / SGLang
extension of the API) and the usage in the stream (stream_options.include_usage): the output token
count is the server's usage.completion_tokens, and each streamed chunk with a choice is an arrival
(TTFT: the first; ITL: the gaps between them). A request starts when it is sent.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed

from dayzero.bench.metrics import RequestRecord, RunResult
from dayzero.bench.workload import BenchRequest

COMPLETIONS = "/v1/completions"
READ_TIMEOUT_S = 600  # per blocking read of the stream, not per request
# no proxies from the environment (http_proxy): a proxy in the path would be measured too
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def base_url(url: str) -> str:
    """The server's root: URL without a trailing slash or /v1 (both forms are accepted)."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {url!r} must start with http:// or https://")
    return url[:-3] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model GET /v1/models lists; ValueError naming --url when the server cannot be reached."""
    try:
        with _OPENER.open(urllib.request.Request(f"{url}/v1/models", headers=_headers(api_key)),
                                    timeout=30) as r:
            models = json.load(r)["data"]
    except urllib.error.HTTPError as exc:
        raise ValueError(f"--url {url}: GET /v1/models answered {exc.code}: {_error_message(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"--url {url}: cannot reach the server ({reason}); is it running?") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--url {url}: GET /v1/models did not return an OpenAI model list") from None
    if not models:
        raise ValueError(f"--url {url}: the server lists no model (GET /v1/models)")
    return models[0]["id"]


def _error_message(exc: urllib.error.HTTPError) -> str:
    body = exc.read().decode(errors="replace")
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200] or exc.reason


def send(url: str, model: str, request: BenchRequest, ignore_eos: bool, api_key: str | None = None) -> RequestRecord:
    """One streaming completion, timed; a failure is recorded in the record's error, not raised."""
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if request.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": request.json_schema}}
    http_request = urllib.request.Request(f"{url}{COMPLETIONS}", data=json.dumps(body).encode(),
                                          headers=_headers(api_key), method="POST")
    record = RequestRecord(len(request.prompt_token_ids), time.perf_counter())
    chunks = 0
    usage = None
    try:
        with _OPENER.open(http_request, timeout=READ_TIMEOUT_S) as response:
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"].get("message", event["error"]))
                    break
                if event.get("choices"):
                    record.token_times.append(time.perf_counter())
                    chunks += 1
                if event.get("usage"):
                    usage = event["usage"]
        record.end = time.perf_counter()
    except urllib.error.HTTPError as exc:
        record.error = f"HTTP {exc.code}: {_error_message(exc)}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.output_len = usage["completion_tokens"] if usage else chunks
    if record.error is None and not record.token_times:
        record.error = "the stream ended without a token"
    return record


def run_remote(url: str, model: str, requests: list[BenchRequest], max_concurrency: int | None,
               ignore_eos: bool = True, api_key: str | None = None, progress=None) -> RunResult:
    """Send every request with at most max_concurrency in flight (None: all at once) and time them."""
    workers = len(requests) if max_concurrency is None else min(max_concurrency, len(requests))
    records: list[RequestRecord | None] = [None] * len(requests)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dayzero-bench") as pool:
        start = time.perf_counter()
        futures = {pool.submit(send, url, model, r, ignore_eos, api_key): i for i, r in enumerate(requests)}
        for future in as_completed(futures):
            records[futures[future]] = future.result()
            if progress is not None:
                progress.update(1)
    duration = max((r.end if r.end is not None else r.start) for r in records) - start
    return RunResult(max_concurrency, records, duration, None)
