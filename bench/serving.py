"""Online serving benchmark: request throughput, TTFT, ITL, TPOT and E2E latency at several
concurrencies, printed in the form `python -m sglang.bench_serving` prints.

Starts `dayzero serve` in-process on 127.0.0.1 (a free port) unless --url is given, then for each
concurrency sends --num-prompts streaming /v1/completions requests of random token ids
(ids in [10, 800); --random-input tokens in, --random-output tokens out, ignore_eos).

    python bench/serving.py --num-prompts 64 --concurrency 1 4 16 --random-input 64 --random-output 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time

import httpx
import numpy as np


def start_server(args) -> str:
    import socket

    import uvicorn

    from dayzero.engine.llm import LLM
    from dayzero.server.app import ServerConfig, create_app

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_running_requests)
    app = create_app(llm, ServerConfig(served_model_name="bench", max_running_requests=args.max_running_requests,
                                       max_queued_requests=4096))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> dict:
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {"ttft": stamps[0] - start, "itl": list(np.diff(stamps)), "e2e": end - start,
            "input": usage["prompt_tokens"], "output": usage["completion_tokens"]}


async def run(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def bounded(p):
            async with sem:
                return await one_request(client, p, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*[bounded(p) for p in prompts])
        return results, time.perf_counter() - start


def report(results: list[dict], duration: float, concurrency: int) -> str:
    ms = lambda xs, f: f(xs) * 1000 if xs else float("nan")  # noqa: E731
    ttft = [r["ttft"] for r in results]
    e2e = [r["e2e"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output"] - 1) for r in results if r["output"] > 1]
    inp, out = sum(r["input"] for r in results), sum(r["output"] for r in results)
    p = lambda q: (lambda xs: float(np.percentile(xs, q)))  # noqa: E731
    rows = [
        ("=" * 16 + " Serving Benchmark Result " + "=" * 16, None),
        ("Backend:", "dayzero"), ("Traffic request rate:", "inf"), ("Max request concurrency:", concurrency),
        ("Successful requests:", len(results)), ("Benchmark duration (s):", f"{duration:.2f}"),
        ("Total input tokens:", inp), ("Total generated tokens:", out),
        ("Request throughput (req/s):", f"{len(results) / duration:.2f}"),
        ("Input token throughput (tok/s):", f"{inp / duration:.2f}"),
        ("Output token throughput (tok/s):", f"{out / duration:.2f}"),
        ("Total token throughput (tok/s):", f"{(inp + out) / duration:.2f}"),
        ("Concurrency:", f"{sum(e2e) / duration:.2f}"),
        ("-" * 15 + "End-to-End Latency" + "-" * 16, None),
        ("Mean E2E Latency (ms):", f"{ms(e2e, statistics.mean):.2f}"),
        ("Median E2E Latency (ms):", f"{ms(e2e, statistics.median):.2f}"),
        ("P99 E2E Latency (ms):", f"{ms(e2e, p(99)):.2f}"),
        ("-" * 15 + "Time to First Token" + "-" * 15, None),
        ("Mean TTFT (ms):", f"{ms(ttft, statistics.mean):.2f}"),
        ("Median TTFT (ms):", f"{ms(ttft, statistics.median):.2f}"),
        ("P99 TTFT (ms):", f"{ms(ttft, p(99)):.2f}"),
        ("-----Time per Output Token (excl. 1st token)------", None),
        ("Mean TPOT (ms):", f"{ms(tpot, statistics.mean):.2f}"),
        ("Median TPOT (ms):", f"{ms(tpot, statistics.median):.2f}"),
        ("P99 TPOT (ms):", f"{ms(tpot, p(99)):.2f}"),
        ("-" * 15 + "Inter-Token Latency" + "-" * 15, None),
        ("Mean ITL (ms):", f"{ms(itl, statistics.mean):.2f}"),
        ("Median ITL (ms):", f"{ms(itl, statistics.median):.2f}"),
        ("P95 ITL (ms):", f"{ms(itl, p(95)):.2f}"),
        ("P99 ITL (ms):", f"{ms(itl, p(99)):.2f}"),
        ("Max ITL (ms):", f"{ms(itl, max):.2f}"),
        ("=" * 58, None),
    ]
    return "\n".join(k if v is None else f"{k:<40}{v:<10}" for k, v in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one in-process)")
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-running-requests", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--random-input", type=int, default=64, help="prompt tokens")
    parser.add_argument("--random-output", type=int, default=32, help="output tokens (ignore_eos)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    url = args.url or start_server(args)
    httpx.get(f"{url}/v1/models").raise_for_status()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 800) for _ in range(args.random_input)] for _ in range(args.num_prompts)]
    asyncio.run(run(url, prompts[:2], 2, 2))  # warm-up
    summary = []
    for c in args.concurrency:
        results, duration = asyncio.run(run(url, prompts, args.random_output, c))
        print(report(results, duration, c), flush=True)
        summary.append((c, sum(r["output"] for r in results) / duration))
    offline = offline_throughput(args, prompts)
    print(f"\nBaseline in the same run: offline LLM.generate of the same {len(prompts)} prompts, "
          f"{offline:.2f} output tok/s")
    print(f"{'concurrency':>12} {'server tok/s':>14} {'offline tok/s':>14} {'server/offline':>15}")
    for c, tps in summary:
        print(f"{c:>12} {tps:>14.2f} {offline:>14.2f} {tps / offline:>15.2f}")


def offline_throughput(args, prompts) -> float:
    """Output tokens per second of the offline engine on the same prompts and lengths (no HTTP)."""
    from dayzero import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_running_requests)
    params = SamplingParams(max_tokens=args.random_output, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
