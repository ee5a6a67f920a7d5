"""Where one engine step's time goes on CUDA: a torch.profiler trace of a few decode steps (and one
prefill step) of a checkpoint, the top ops by host and by device time, the kernel count, and the
wall time of each step phase, plus dayzero's bf16 logits against transformers' on the same prompt.

    python tools/profile_step.py /tmp/gpt-oss-20b --batch 1 64 [--compare] [--eager] [--pyprof]

--eager: decode steps without CUDA graphs (every launch from Python); --pyprof: also the Python functions
that take the host time of those decode steps (cProfile, by own time and by cumulative time).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def _pyprof(engine, rows: int, steps: int = 5) -> None:
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    print(f"cProfile: {1e3 * (time.perf_counter() - t0) / steps:.1f} ms a decode step (profiled)")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--compare", action="store_true", help="prefill logits vs transformers (bf16)")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--eager", action="store_true", help="cuda_graphs=False")
    ap.add_argument("--pyprof", action="store_true", help="cProfile the profiled decode steps")
    args = ap.parse_args()
    from dayzero import LLM, SamplingParams

    llm = LLM(args.model, device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=8192,
              max_model_len=4096, kv_cache_gib=8, cuda_graphs=not args.eager)
    engine, vocab = llm.engine, llm.vocab_size
    for batch in args.batch:
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
        for rep in range(2):
            for i, p in enumerate(_prompts(batch, 128, vocab, batch)):
                engine.add_request(f"b{batch}-{rep}-{i}", *engine.validate(p, params))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            print(f"batch {batch} rep {rep}: prefill step {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
            for _ in range(3):
                engine.step()
            if rep == 1:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        engine.step()
                torch.cuda.synchronize()
                events = prof.key_averages()
                kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
                print(f"batch {batch}: {kernels / 3:.0f} kernels per decode step")
                print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
                print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
                if args.pyprof:
                    _pyprof(engine, args.rows)
            times = []
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            print(f"batch {batch} rep {rep}: decode steps ms {[round(t * 1e3, 1) for t in times]}", flush=True)
            for rid in list(engine.tracks):
                engine.pop_finished(rid)
    if args.compare:
        from transformers import AutoModelForCausalLM

        ids = torch.tensor(_prompts(1, 128, vocab, 3), device="cuda")
        with torch.no_grad():
            ours = llm.model(ids, torch.arange(128, device="cuda")[None])[0]
        del llm, engine
        torch.cuda.empty_cache()
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda")
        with torch.no_grad():
            theirs = hf(ids).logits[0].float()
        err = ((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1))
        print(f"bf16 prefill logits vs transformers: max rel err per position median {err.median():.2e}, "
              f"max {err.max():.2e}; argmax agree {(ours.argmax(-1) == theirs.argmax(-1)).float().mean():.2f}")


if __name__ == "__main__":
    main()
