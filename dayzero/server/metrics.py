"""Prometheus metrics in the text exposition format, written without a client library.

Names follow SGLang's `sglang:*` series with the `dayzero:` prefix. Latencies are in seconds,
measured on the engine thread: TTFT from submission to the step that produced the first token,
inter-token latency between consecutive steps that produced a token, end-to-end from submission to
the finishing step. Counters only grow; gauges are read from the scheduler when /metrics is scraped.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.buckets, "+Inf"), self.counts):
            total += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    """Written by the engine thread, read by /metrics; one lock keeps a scrape consistent."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # by finish_reason

    def on_prompt(self, num_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += num_tokens

    def on_first_token(self, seconds: float, num_tokens: int) -> None:
        with self.lock:
            self.ttft.observe(seconds)
            self.generation_tokens += num_tokens

    def on_token(self, seconds: float, num_tokens: int) -> None:
        with self.lock:
            self.itl.observe(seconds)
            self.generation_tokens += num_tokens

    def on_finish(self, reason: str | None, seconds: float | None = None) -> None:
        with self.lock:
            self.finished[reason or "unknown"] = self.finished.get(reason or "unknown", 0) + 1
            if seconds is not None:
                self.e2e.observe(seconds)

    def render(self, model_name: str, gauges: dict[str, tuple[str, float]]) -> str:
        """gauges: name -> (help, value)."""
        labels = f'model_name="{model_name}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, body: list[str]):
            lines.extend([f"# HELP dayzero:{name} {help_}", f"# TYPE dayzero:{name} {kind}", *body])

        for name, (help_, value) in gauges.items():
            metric(name, "gauge", help_, [f"dayzero:{name}{{{labels}}} {value}"])
        with self.lock:
            metric("prompt_tokens_total", "counter", "Prompt tokens of requests admitted.",
                   [f"dayzero:prompt_tokens_total{{{labels}}} {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "Tokens generated.",
                   [f"dayzero:generation_tokens_total{{{labels}}} {self.generation_tokens}"])
            metric("request_finished_total", "counter", "Requests finished, by finish_reason.",
                   [f'dayzero:request_finished_total{{{labels},finish_reason="{r}"}} {n}'
                    for r, n in sorted(self.finished.items())])
            metric("time_to_first_token_seconds", "histogram", "Time to first token (s).",
                   self.ttft.lines("dayzero:time_to_first_token_seconds", labels))
            metric("inter_token_latency_seconds", "histogram", "Time between consecutive tokens of a request (s).",
                   self.itl.lines("dayzero:inter_token_latency_seconds", labels))
            metric("e2e_request_latency_seconds", "histogram", "Submission to last token (s).",
                   self.e2e.lines("dayzero:e2e_request_latency_seconds", labels))
        return "\n".join(lines) + "\n"
