"""Reliability soak and overload of `dayzero serve` (RELIABILITY.md), on loopback, stopping by itself.

Soak: `--workers` clients send a mix for `--duration` seconds: completions, chat and /generate, streaming
and not, n = 2, long and short prompts, prompts sharing prefixes, stop strings, clients that hang up
before the answer and streams closed part-way. Recorded: requests sent / completed / failed / cut by the
client, p50 / p99 latency, the server's memory (RSS) and KV pool occupancy over time. Pass: no 5xx and
no lost valid request (each gets its full answer), memory and pool without an upward trend, and at the
end the pool fully free with no request left tracked.
Overload: the server's capacity (requests/s, closed loop at its in-flight limit), then Poisson arrivals at
0.5x ... 3x that rate. Pass: only 200 and 503 (with Retry-After), the 503s early, goodput that holds up,
admitted requests' latency bounded by the queue.

    python bench/soak.py                                      # 60 s soak + overload sweep, CPU, the demo
    python bench/soak.py --duration 1800                      # the 30-minute soak
    python bench/soak.py --inject-faults oom/40               # out-of-memory steps injected (retried, no 5xx)

It starts `python -m dayzero serve` on 127.0.0.1 (a free port) and stops it with SIGTERM at the end (it
must drain and exit 0). Figures are printed; JSON, a PNG and the server's log go to --output-dir
(bench/results/, not committed). Exit code 1 if any check fails. tests/bench/test_soak.py runs a short
version in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

KINDS = {  # kind -> weight in the mix
    "completion": 3, "completion_stream": 3, "chat": 2, "chat_stream": 2, "generate": 2, "generate_stream": 1,
    "n2": 1, "long_prompt": 1, "stop": 1, "hang_up": 1, "stream_cut": 1,
}
WORDS = ["sea", "light", "keeper", "stone", "wind", "harbour", "night", "lamp", "rope", "gull", "7", "tide"]
OVERLOAD_MULTIPLES = (0.5, 1.0, 1.5, 2.0, 3.0)


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


# -- one request of the mix ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    status: str  # "ok" | "failed" | "cut" (the client hung up on purpose)
    latency: float
    detail: str = ""


class Traffic:
    """Builds and checks the soak's requests (seeded)."""

    def __init__(self, seed: int, vocab: int = 800, long_prompt: tuple[int, int] = (400, 1200),
                 max_tokens: tuple[int, int] = (4, 24), first: tuple[str, ...] = ()):
        """first: the kinds of the first requests, in order, before the seeded mix (a short run's must-haves)."""
        self.rng = random.Random(seed)
        self.first = list(first)
        self.vocab, self.long_prompt, self.max_tokens = vocab, long_prompt, max_tokens
        self.prefixes = [[self.rng.randrange(10, vocab) for _ in range(n)] for n in (48, 96, 160, 200)]
        self.systems = [" ".join(self.rng.choice(WORDS) for _ in range(n)) for n in (30, 60)]

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    def prompt_ids(self, long: bool = False) -> list[int]:
        if long:
            return self.ids(self.rng.randint(*self.long_prompt))
        if self.rng.random() < 0.5:  # a shared prefix: prefix cache hits
            return self.rng.choice(self.prefixes) + self.ids(self.rng.randint(1, 24))
        return self.ids(self.rng.randint(2, 40))

    def text(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 20)))

    async def send(self, client: httpx.AsyncClient, kind: str) -> Outcome:
        r, m = self.rng, self.rng.randint(*self.max_tokens)
        start = time.perf_counter()

        def done(ok: bool, detail: str = "") -> Outcome:
            return Outcome(kind, "ok" if ok else "failed", time.perf_counter() - start, detail)

        try:
            if kind in ("completion", "n2", "long_prompt", "stop"):
                n = 2 if kind == "n2" else 1
                body = {"prompt": self.prompt_ids(long=kind == "long_prompt"), "max_tokens": m, "n": n,
                        "ignore_eos": True, "temperature": r.choice([0, 0.8]), "seed": r.randrange(1000)}
                if kind == "stop":
                    body.update(stop=[r.choice(["e", "a", " s"])], stop_token_ids=[r.randrange(10, self.vocab)])
                resp = await client.post("/v1/completions", json=body)
                if resp.status_code != 200:
                    return done(False, f"{resp.status_code} {resp.text[:200]}")
                out = resp.json()
                choices, usage = out["choices"], out["usage"]
                ok = len(choices) == n and all(c["finish_reason"] in ("stop", "length") for c in choices)
                if kind != "stop":
                    ok = ok and usage["completion_tokens"] == n * m
                return done(ok, json.dumps(out)[:200])
            if kind == "chat":
                messages = [{"role": "system", "content": r.choice(self.systems)}, {"role": "user", "content": self.text()}]
                resp = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": m,
                                                                       "ignore_eos": True})
                ok = resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == m
                return done(ok, resp.text[:200])
            if kind == "generate":
                resp = await client.post("/generate", json={"input_ids": self.prompt_ids(), "sampling_params": {
                    "max_new_tokens": m, "ignore_eos": True, "temperature": 0}})
                ok = resp.status_code == 200 and len(resp.json()["output_ids"]) == m
                return done(ok, resp.text[:200])
            if kind in ("completion_stream", "chat_stream", "generate_stream", "stream_cut"):
                route, body = self._stream_body(kind, m)
                cut = r.randint(1, 4) if kind == "stream_cut" else None
                events = []
                async with client.stream("POST", route, json=body) as s:
                    if s.status_code != 200:
                        return done(False, f"{s.status_code} {(await s.aread())[:200]!r}")
                    async for line in s.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if cut is not None and len(events) >= cut:
                                return Outcome(kind, "cut", time.perf_counter() - start)
                if not events or events[-1] != "[DONE]" or any(e.startswith('{"error"') for e in events):
                    return done(False, str(events[-3:]))
                if kind == "completion_stream":
                    return done(json.loads(events[-2])["usage"]["completion_tokens"] == m, events[-2][:200])
                if kind == "generate_stream":
                    return done(len(json.loads(events[-2])["output_ids"]) == m, events[-2][:200])
                return done(any('"finish_reason": "length"' in e for e in events), str(events[-3:]))
            if kind == "hang_up":  # a non-streaming request whose client gives up before the answer
                body = {"prompt": self.prompt_ids(), "max_tokens": 200, "ignore_eos": True}
                try:
                    await asyncio.wait_for(client.post("/v1/completions", json=body), r.uniform(0.05, 0.5))
                except asyncio.TimeoutError:
                    return Outcome(kind, "cut", time.perf_counter() - start)
                return done(True)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return done(False, repr(exc))
        raise ValueError(f"unknown kind {kind!r}")

    def _stream_body(self, kind: str, m: int) -> tuple[str, dict]:
        if kind == "chat_stream":
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": self.text()}], "max_tokens": m,
                                            "ignore_eos": True, "stream": True}
        if kind == "generate_stream":
            return "/generate", {"input_ids": self.prompt_ids(), "stream": True,
                                 "sampling_params": {"max_new_tokens": m, "ignore_eos": True}}
        return "/v1/completions", {"prompt": self.prompt_ids(), "max_tokens": m if kind != "stream_cut" else 200,
                                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def kind(self) -> str:
        if self.first:
            return self.first.pop(0)
        return self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]


# -- the soak -------------------------------------------------------------------------------------------------
@dataclass
class SoakResult:
    duration: float
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # t, rss_mib, kv_usage, running, queued, p50, p99, completed
    final: dict = field(default_factory=dict)  # /get_server_info once idle

    def counts(self) -> dict:
        c = {"sent": len(self.outcomes)}
        for status in ("ok", "failed", "cut"):
            c[status] = sum(o.status == status for o in self.outcomes)
        return c

    def checks(self) -> dict[str, tuple[bool, str]]:
        c, rss = self.counts(), [s["rss_mib"] for s in self.samples if s["rss_mib"] is not None]
        failures = [o for o in self.outcomes if o.status == "failed"]
        pool = self.final.get("kv_pool", {})
        settled = rss[len(rss) // 5:]  # after the warm-up
        half = len(settled) // 2
        growth = statistics.median(settled[half:]) - statistics.median(settled[:half]) if half >= 2 else 0.0
        allowed = max(32.0, 0.05 * statistics.median(settled)) if settled else 0.0
        usage = [s["kv_usage"] for s in self.samples]
        trend = float(np.polyfit(np.arange(len(usage)), usage, 1)[0] * len(usage)) if len(usage) >= 4 else 0.0
        return {
            "no failed or lost request": (not failures and c["ok"] + c["cut"] == c["sent"],
                                          f"{len(failures)} failed" + (f", first: {failures[0].kind} {failures[0].detail}"
                                                                       if failures else "")),
            "memory flat": (growth <= allowed, f"RSS median grew {growth:+.1f} MiB over the run's second half "
                                               f"(allowed {allowed:.0f})"),
            "KV pool without trend": (trend < 0.25, f"occupancy trend {trend:+.3f} of the pool over the run"),
            "pool free at the end": (pool.get("num_free_blocks") == pool.get("num_blocks") and
                                     self.final.get("num_in_flight_reqs") == 0 and self.final.get("num_tracked_reqs") == 0
                                     and self.final.get("num_state_slots_held") == 0,
                                     f"{pool.get('num_free_blocks')} of {pool.get('num_blocks')} blocks free, "
                                     f"{self.final.get('num_tracked_reqs')} tracked, "
                                     f"{self.final.get('num_state_slots_held')} state slots held"),
        }


async def soak(url: str, duration: float, workers: int, rss: Callable[[], float | None], seed: int = 0,
               interval: float = 2.0, headers: dict | None = None, traffic: Traffic | None = None) -> SoakResult:
    result = SoakResult(duration)
    traffic = traffic or Traffic(seed)
    stop_at = time.perf_counter() + duration
    start = time.perf_counter()
    window: list[Outcome] = []
    limits = httpx.Limits(max_connections=workers + 4, max_keepalive_connections=workers + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers=headers) as client:
        async def worker():
            while time.perf_counter() < stop_at:
                outcome = await traffic.send(client, traffic.kind())
                result.outcomes.append(outcome)
                window.append(outcome)

        async def sampler():
            while time.perf_counter() < stop_at:
                await asyncio.sleep(interval)
                info = (await client.get("/get_server_info")).json()
                lat = [o.latency for o in window if o.status == "ok"]
                result.samples.append({
                    "t": time.perf_counter() - start, "rss_mib": rss(), "kv_usage": info["kv_pool"]["usage"],
                    "running": info["num_running_reqs"], "queued": info["num_queued_reqs"],
                    "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99), "completed": len(lat),
                    "sent_total": len(result.outcomes)})
                window.clear()

        await asyncio.gather(sampler(), *[worker() for _ in range(workers)])
        result.final = await wait_idle(client)
    return result


async def wait_idle(client: httpx.AsyncClient, timeout: float = 60) -> dict:
    """/get_server_info once nothing is in flight and the pool is free (or the last one after timeout)."""
    deadline = time.perf_counter() + timeout
    while True:
        info = (await client.get("/get_server_info")).json()
        pool = info["kv_pool"]
        if (pool["num_free_blocks"] == pool["num_blocks"] and info["num_in_flight_reqs"] == 0) or \
                time.perf_counter() > deadline:
            return info
        await asyncio.sleep(0.1)


# -- overload -------------------------------------------------------------------------------------------------
OVERLOAD_BODY = {"max_tokens": 16, "ignore_eos": True, "temperature": 0}
OVERLOAD_PROMPT = 32


async def capacity(url: str, concurrency: int, duration: float, seed: int = 1) -> float:
    """Requests/s the server completes with `concurrency` clients always waiting (its in-flight limit)."""
    rng = random.Random(seed)
    done = 0
    stop_at = time.perf_counter() + duration
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        async def loop():
            nonlocal done
            while time.perf_counter() < stop_at:
                body = {"prompt": [rng.randrange(10, 800) for _ in range(OVERLOAD_PROMPT)], **OVERLOAD_BODY}
                if (await c.post("/v1/completions", json=body)).status_code == 200:
                    done += 1
        start = time.perf_counter()
        await asyncio.gather(*[loop() for _ in range(concurrency)])
        return done / (time.perf_counter() - start)


async def offered(url: str, rate: float, duration: float, seed: int = 2) -> dict:
    """Poisson arrivals at `rate` requests/s for `duration` s: goodput, admitted latency, rejections."""
    rng = random.Random(seed)
    ok, rejected, other, reject_s, retry_after = [], [], [], [], set()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=4096)) as c:
        async def one(body):
            start = time.perf_counter()
            try:
                resp = await c.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                other.append(repr(exc))
                return
            took = time.perf_counter() - start
            if resp.status_code == 200:
                ok.append((took, time.perf_counter()))
            elif resp.status_code == 503:
                rejected.append(took)
                retry_after.add(resp.headers.get("retry-after"))
            else:
                other.append(f"{resp.status_code} {resp.text[:120]}")

        tasks, start = [], time.perf_counter()
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t > duration:
                break
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            body = {"prompt": [rng.randrange(10, 800) for _ in range(OVERLOAD_PROMPT)], **OVERLOAD_BODY}
            tasks.append(asyncio.ensure_future(one(body)))
        await asyncio.gather(*tasks)
    end = max([f for _, f in ok], default=start + duration)
    latencies = [d for d, _ in ok]
    return {"offered_rps": len(tasks) / duration, "sent": len(tasks), "ok": len(ok), "rejected": len(rejected),
            "other": len(other), "other_first": other[:1], "goodput_rps": len(ok) / max(end - start, duration),
            "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99),
            "reject_p99_s": percentile(rejected, 99), "retry_after": sorted(map(str, retry_after))}


async def overload(url: str, max_in_flight: int, duration: float, multiples=OVERLOAD_MULTIPLES) -> dict:
    cap = await capacity(url, max_in_flight, duration)
    points = []
    for m in multiples:
        points.append({"multiple": m, **await offered(url, m * cap, duration, seed=int(m * 10))})
    return {"capacity_rps": cap, "max_in_flight": max_in_flight, "points": points}


def overload_checks(result: dict) -> dict[str, tuple[bool, str]]:
    cap, points = result["capacity_rps"], result["points"]
    top = points[-1]
    base = next((p["p99_s"] for p in points if p["p99_s"] is not None), None) or 0.0
    bound = 2 * result["max_in_flight"] / cap + base  # the queue's worth of service time, twice, plus a light load's
    others = sum(p["other"] for p in points)
    rejects = [p["reject_p99_s"] for p in points if p["reject_p99_s"] is not None]
    return {
        "only 200 and 503": (others == 0 and all(p["retry_after"] in ([], ["1"]) for p in points),
                             f"{others} other answers" + (f", first: {next(p['other_first'] for p in points if p['other'])}"
                                                          if others else "")),
        "excess rejected early": (bool(rejects) and max(rejects) < 1.0 and top["rejected"] > 0,
                                  f"503 p99 {max(rejects) * 1000:.0f} ms at worst, {top['rejected']} at "
                                  f"{top['multiple']}x" if rejects else "no 503 at all"),
        "goodput holds": (top["goodput_rps"] >= 0.7 * cap, f"{top['goodput_rps']:.2f} req/s at {top['multiple']}x "
                                                            f"the capacity of {cap:.2f} req/s"),
        "admitted latency bounded": (all(p["p99_s"] is None or p["p99_s"] <= bound for p in points),
                                     f"p99 at most {max((p['p99_s'] or 0) for p in points):.2f} s (bound {bound:.2f} s)"),
    }


# -- printing and the figure ------------------------------------------------------------------------------------
def report(soak_result: SoakResult | None, over: dict | None) -> str:
    lines = []
    if soak_result is not None:
        c = soak_result.counts()
        lat = [o.latency for o in soak_result.outcomes if o.status == "ok"]
        rss = [s["rss_mib"] for s in soak_result.samples if s["rss_mib"] is not None]
        lines += [f"soak {soak_result.duration:.0f} s: sent {c['sent']}, completed {c['ok']}, failed {c['failed']}, "
                  f"cut by the client {c['cut']}; latency p50 {percentile(lat, 50) or 0:.3f} s, "
                  f"p99 {percentile(lat, 99) or 0:.3f} s",
                  f"  RSS {min(rss, default=0):.0f}-{max(rss, default=0):.0f} MiB; KV pool occupancy peak "
                  f"{max((s['kv_usage'] for s in soak_result.samples), default=0):.2f}; by kind: " +
                  ", ".join(f"{k} {sum(o.kind == k for o in soak_result.outcomes)}" for k in KINDS)]
        lines += [f"  {'PASS' if ok else 'FAIL'}  {name}: {why}" for name, (ok, why) in soak_result.checks().items()]
    if over is not None:
        lines.append(f"overload: capacity {over['capacity_rps']:.2f} req/s (closed loop at {over['max_in_flight']} in "
                     f"flight; {OVERLOAD_PROMPT} prompt + {OVERLOAD_BODY['max_tokens']} output tokens)")
        lines.append(f"  {'offered':>8} {'req/s':>7} {'goodput':>8} {'ok':>5} {'503':>5} {'other':>5} {'p50 s':>7} "
                     f"{'p99 s':>7} {'503 p99 ms':>10}")
        for p in over["points"]:
            lines.append(f"  {p['multiple']:>7.1f}x {p['offered_rps']:>7.2f} {p['goodput_rps']:>8.2f} {p['ok']:>5} "
                         f"{p['rejected']:>5} {p['other']:>5} {p['p50_s'] or 0:>7.2f} {p['p99_s'] or 0:>7.2f} "
                         f"{(p['reject_p99_s'] or 0) * 1000:>10.1f}")
        lines += [f"  {'PASS' if ok else 'FAIL'}  {name}: {why}" for name, (ok, why) in overload_checks(over).items()]
    return "\n".join(lines)


def write_png(path: Path, soak_result: SoakResult | None, over: dict | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    if soak_result is not None and soak_result.samples:
        s = soak_result.samples
        t = [x["t"] / 60 for x in s]
        ax = axes[0][0]
        ax.plot(t, [x["p50_s"] for x in s], label="p50")
        ax.plot(t, [x["p99_s"] for x in s], label="p99")
        ax.set(title="soak: latency of completed requests", xlabel="minutes", ylabel="s")
        ax = axes[0][1]
        ax.plot(t, [x["rss_mib"] for x in s])
        ax.set(title="soak: server memory (RSS)", xlabel="minutes", ylabel="MiB")
        ax = axes[0][2]
        ax.plot(t, [x["kv_usage"] for x in s], label="KV pool occupancy")
        ax.set(title="soak: KV pool", xlabel="minutes", ylabel="fraction held", ylim=(0, 1))
        ax2 = ax.twinx()
        ax2.plot(t, [x["running"] for x in s], "g:", label="running")
        ax2.plot(t, [x["queued"] for x in s], "r:", label="queued")
        ax2.set_ylabel("requests")
        ax2.legend(fontsize=8, loc="upper right")
        ax = axes[1][0]
        ax.plot(t, [x["sent_total"] for x in s])
        ax.set(title="soak: requests sent (cumulative)", xlabel="minutes", ylabel="requests")
    if over is not None:
        x = [p["offered_rps"] for p in over["points"]]
        ax = axes[1][1]
        ax.plot(x, [p["goodput_rps"] for p in over["points"]], "o-", label="goodput (200/s)")
        ax.plot(x, x, "k:", label="offered")
        ax.axhline(over["capacity_rps"], color="gray", ls="--", label="capacity")
        ax.set(title="overload: goodput", xlabel="offered req/s", ylabel="req/s")
        ax = axes[1][2]
        ax.plot(x, [p["p50_s"] for p in over["points"]], "o-", label="admitted p50")
        ax.plot(x, [p["p99_s"] for p in over["points"]], "s-", label="admitted p99")
        ax.set(title="overload: latency and rejections", xlabel="offered req/s", ylabel="s")
        ax2 = ax.twinx()
        ax2.plot(x, [p["rejected"] / max(p["sent"], 1) for p in over["points"]], "r^:", label="rejected (503) share")
        ax2.set(ylabel="share rejected", ylim=(0, 1))
        ax2.legend(fontsize=8, loc="center right")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the server --------------------------------------------------------------------------------------------------
def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def start_server(args, log: Path) -> tuple[subprocess.Popen, str]:
    """`dayzero serve` on a free loopback port, its output into `log` (a pipe nobody reads would fill and
    stall the server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if args.inject_faults:
        env["DAYZERO_INJECT_FAULTS"] = args.inject_faults
    cmd = [sys.executable, "-m", "dayzero", "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
           "--max-running-requests", str(args.max_running_requests), "--max-queued-requests",
           str(args.max_queued_requests), *(["--kv-cache-gib", str(args.kv_cache_gib)] if args.kv_cache_gib else []),
           *([args.model] if args.model else [])]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not come up in 300 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60, help="soak seconds (default 60; 1800: the 30-minute soak)")
    p.add_argument("--workers", type=int, default=6, help="soak clients (n=2 requests count twice: keep 2 x workers "
                   "within the server's in-flight limit)")
    p.add_argument("--interval", type=float, default=None, help="seconds between samples (default duration / 60)")
    p.add_argument("--overload-duration", type=float, default=20, help="seconds per offered load (0: no overload)")
    p.add_argument("--model", default=None, help="checkpoint (default: the demo)")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--max-queued-requests", type=int, default=8)
    p.add_argument("--kv-cache-gib", type=float, default=0.005,
                   help="the server's KV pool (default 0.005 GiB: about 330 blocks of the demo's, small enough that "
                   "long prompts fill it and requests get preempted; 0: the server's default)")
    p.add_argument("--inject-faults", default=None, help="DAYZERO_INJECT_FAULTS for the server, e.g. oom/40")
    p.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if 2 * args.workers > args.max_running_requests + args.max_queued_requests:
        p.error("2 x --workers must fit --max-running-requests + --max-queued-requests (else the soak sees 503s)")
    proc, url = start_server(args, args.output_dir / "soak-server.log")
    try:
        soak_result = asyncio.run(soak(url, args.duration, args.workers, lambda: rss_mib(proc.pid), args.seed,
                                       args.interval or max(args.duration / 60, 1.0))) if args.duration > 0 else None
        over = asyncio.run(overload(url, args.max_running_requests + args.max_queued_requests, args.overload_duration)
                           ) if args.overload_duration > 0 else None
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    log = (args.output_dir / "soak-server.log").read_text()
    errors = log.count("Traceback") + log.count("ERROR")
    text = report(soak_result, over) + (
        f"\n  {'PASS' if code == 0 else 'FAIL'}  SIGTERM: the server drained and exited with {code}"
        f"\n  {'PASS' if not errors else 'FAIL'}  the server logged {errors} error(s) or traceback(s)")
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    title = (f"dayzero serve {args.model or '(demo)'}, CPU, {os.cpu_count()} cores, {stamp}: soak {args.duration:.0f} s, "
             f"{args.workers} clients; overload {args.overload_duration:.0f} s per point"
             + (f"; faults {args.inject_faults}" if args.inject_faults else ""))
    (args.output_dir / "soak.json").write_text(json.dumps({
        "title": title, "command": " ".join(sys.argv), "report": text,
        "soak": None if soak_result is None else {"counts": soak_result.counts(), "samples": soak_result.samples,
                                                  "final": soak_result.final},
        "overload": over}, indent=1, default=str))
    write_png(args.output_dir / "soak.png", soak_result, over, title)
    print(f"figures: {args.output_dir / 'soak.json'}, {args.output_dir / 'soak.png'}")
    checks = [*(soak_result.checks().values() if soak_result else []), *(overload_checks(over).values() if over else [])]
    return 0 if code == 0 and not errors and all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
