"""Where a CUDA-graph decode step's time goes: the engine step's wall time, the graph replay's GPU time
alone (CUDA events over back-to-back replays), the host phases of a step (schedule, metadata fill,
replay launch, sampling, update), and the kernels inside the graph by GPU time (torch.profiler).

    python tools/profile_graph_step.py /tmp/gpt-oss-20b --batch 1 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def _timed(fn, totals: dict, name: str):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        totals.setdefault(name, []).append(time.perf_counter() - t0)
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args()
    from dayzero import LLM, SamplingParams

    llm = LLM(args.model, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batch), max_model_len=4096,
              kv_cache_gib=8, enable_prefix_caching=False)
    engine, graphs = llm.engine, llm.runner.graphs
    print(f"capture {graphs.capture_seconds:.1f} s, buckets {graphs.buckets}")
    phases: dict = {}
    engine.scheduler.schedule = _timed(engine.scheduler.schedule, phases, "schedule")
    graphs.static.fill = _timed(graphs.static.fill, phases, "fill")
    engine.sampler.__class__.__call__ = _timed(engine.sampler.__class__.__call__, phases, "sample+copy")
    engine.scheduler.update = _timed(engine.scheduler.update, phases, "update")
    for batch in args.batch:
        params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
        for i, p in enumerate(_prompts(batch, 128, llm.vocab_size, batch)):
            engine.add_request(f"b{batch}-{i}", *engine.validate(p, params))
        for _ in range(5):
            engine.step()
        phases.clear()
        walls = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
        b = graphs.bucket(batch)
        g = graphs.graphs[b]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        gpu = start.elapsed_time(end) / 50
        print(f"\nbatch {batch} (bucket {b}): engine step median {1e3 * statistics.median(walls):.3f} ms, "
              f"graph replay GPU {gpu:.3f} ms")
        for name, ts in phases.items():
            print(f"  host {name:12} {1e6 * statistics.median(ts):8.1f} us")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
        events = prof.key_averages()
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
