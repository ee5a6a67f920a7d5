"""What a benchmark run measures, per request and in summary, with the metric names of
`vllm bench serve` / `sglang.bench_serving` (their JSON keys).

Units: times are seconds from time.perf_counter in the records, milliseconds in the summary's *_ms
keys; throughputs are per second of the run's duration (first request sent to last request done).
- TTFT: first token's arrival - the request's start (sent over HTTP, or admitted to the engine).
- ITL: the gaps between a request's consecutive token arrivals (over HTTP: between streamed
  chunks, as vLLM and SGLang count them; a chunk can carry more than one token).
- TPOT: (E2E latency - TTFT) / (output tokens - 1), per request with more than one output token.
- E2E latency (e2el): the request's end - its start.
- concurrency: the sum of E2E latencies / duration, the average number of requests in flight.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    prompt_len: int
    start: float
    token_times: list[float] = field(default_factory=list)  # arrival of each token (or chunk)
    output_len: int = 0  # tokens generated (the server's usage count over HTTP)
    end: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return np.diff(self.token_times).tolist()

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 and self.token_times else None


@dataclass
class PeakMemory:
    """The peak memory a run reached: torch.cuda.max_memory_allocated on CUDA (reset when the run
    starts), the process's max resident set size on CPU (since the process started: it cannot be reset)."""

    bytes: int
    kind: str  # "cuda max_memory_allocated" | "process max RSS"

    @staticmethod
    def reset(device) -> None:
        import torch

        if torch.device(device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @classmethod
    def read(cls, device) -> "PeakMemory":
        import torch

        if torch.device(device).type == "cuda":
            return cls(torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return cls(rss if sys.platform == "darwin" else rss * 1024, "process max RSS")  # Linux reports KiB


@dataclass
class RunResult:
    """One concurrency level: every request's record and the run's wall time."""

    max_concurrency: int | None  # None: every request at once
    records: list[RequestRecord]
    duration: float
    peak_memory: PeakMemory | None = None  # None: not measured (another process: a server behind --url)

    def summary(self) -> dict:
        ok = [r for r in self.records if r.ok]
        inp = sum(r.prompt_len for r in ok)
        out = sum(r.output_len for r in ok)
        d = self.duration
        result = {
            "max_concurrency": self.max_concurrency,
            "completed": len(ok),
            "failed": len(self.records) - len(ok),
            "duration": d,
            "total_input_tokens": inp,
            "total_output_tokens": out,
            "request_throughput": len(ok) / d,
            "input_throughput": inp / d,
            "output_throughput": out / d,
            "total_token_throughput": (inp + out) / d,
            "concurrency": sum(r.e2e for r in ok) / d,
        }
        series = {"ttft": [r.ttft for r in ok if r.ttft is not None],
                  "tpot": [r.tpot for r in ok if r.tpot is not None],
                  "itl": [x for r in ok for x in r.itl],
                  "e2el": [r.e2e for r in ok]}
        for name, values in series.items():
            result.update(_stats(name, values))
        result["peak_memory_bytes"] = self.peak_memory.bytes if self.peak_memory else None
        result["peak_memory_kind"] = self.peak_memory.kind if self.peak_memory else None
        result["input_lens"] = [r.prompt_len for r in self.records]
        result["output_lens"] = [r.output_len for r in self.records]
        result["ttfts"] = [r.ttft for r in self.records]
        result["itls"] = [r.itl for r in self.records]
        result["errors"] = [r.error for r in self.records if r.error is not None]
        return result


def _stats(name: str, seconds: list[float]) -> dict:
    """mean / median / p99 of `seconds` in milliseconds (None when there are none)."""
    if not seconds:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "p99")}
    ms = np.asarray(seconds) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}
