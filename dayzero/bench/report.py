"""The printed report: one block per concurrency level in the layout `sglang.bench_serving` and
`vllm bench serve` print (a 40-column label, then the value), and the dayzero / transformers table."""

from __future__ import annotations

WIDTH = 50


def _rule(title: str = "", fill: str = "-") -> str:
    return f"{title:{fill}^{WIDTH}}" if title else fill * WIDTH


def _value(v, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def format_run(s: dict, backend: str) -> str:
    """One level's summary (RunResult.summary()) as text."""
    concurrency = s["max_concurrency"]
    rows: list[tuple[str, object] | str] = [
        _rule(" Benchmark Result ", "="),
        ("Backend:", backend),
        ("Traffic request rate:", "inf"),
        ("Max request concurrency:", "not set" if concurrency is None else concurrency),
        ("Successful requests:", s["completed"]),
    ]
    if s["failed"]:
        rows.append(("Failed requests:", s["failed"]))
    rows += [
        ("Benchmark duration (s):", s["duration"]),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", s["request_throughput"]),
        ("Input token throughput (tok/s):", s["input_throughput"]),
        ("Output token throughput (tok/s):", s["output_throughput"]),
        ("Total token throughput (tok/s):", s["total_token_throughput"]),
        ("Concurrency:", s["concurrency"]),
    ]
    if s["peak_memory_bytes"] is not None:
        rows.append((f"Peak memory (GiB, {s['peak_memory_kind']}):", s["peak_memory_bytes"] / 2**30))
    else:
        rows.append(("Peak memory (GiB):", "n/a (the server's process)"))
    for title, key in (("End-to-End Latency", "e2el"), ("Time to First Token", "ttft"),
                       ("Time per Output Token (excl. 1st token)", "tpot"), ("Inter-token Latency", "itl")):
        name = {"e2el": "E2E Latency"}.get(key, key.upper())
        rows.append(_rule(title))
        rows += [(f"Mean {name} (ms):", s[f"mean_{key}_ms"]), (f"Median {name} (ms):", s[f"median_{key}_ms"]),
                 (f"P99 {name} (ms):", s[f"p99_{key}_ms"])]
    rows.append(_rule(fill="="))
    return "\n".join(row if isinstance(row, str) else f"{row[0]:<40}{_value(row[1]):<10}" for row in rows)


def format_comparison(ours: list[dict], theirs: list[dict]) -> str:
    """Output tokens/s of dayzero and transformers per concurrency level, and their ratio."""
    lines = [_rule(" dayzero vs transformers (same prompts) ", "="),
             f"{'Max concurrency':<18}{'dayzero tok/s':>14}{'transformers tok/s':>20}{'ratio':>10}"]
    for a, b in zip(ours, theirs):
        c = "not set" if a["max_concurrency"] is None else a["max_concurrency"]
        ratio = a["output_throughput"] / b["output_throughput"]
        lines.append(f"{c!s:<18}{a['output_throughput']:>14.2f}{b['output_throughput']:>20.2f}{ratio:>9.2f}x")
    lines.append(_rule(fill="="))
    return "\n".join(lines)


def format_profile(p: dict) -> str:
    """A level's --profile-steps summary (dayzero/bench/profile.py) as text."""
    rows: list[tuple[str, object] | str] = [
        _rule(f" Collectives: {p['steps']} decode steps of {p['batch']} (rank 0) "),
        ("Step time (ms):", p["step_ms"]), ("Step time under the profiler (ms):", p["profiled_step_ms"])]
    for where, key in (("device", "device_ms_per_step"), ("host", "host_ms_per_step")):
        rows += [(f"{kind} ({where}, ms/step):", ms) for kind, ms in p[key].items()]
    rows += [(f"Share of the step ({p['share_of'].split(' (')[0]}):", f"{100 * p['share']:.1f}%"), _rule(fill="=")]
    return "\n".join(row if isinstance(row, str) else f"{row[0]:<40}{_value(row[1]):<10}" for row in rows)
