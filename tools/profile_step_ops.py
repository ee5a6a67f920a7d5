"""Which op implementations one engine decode step runs on CUDA ({op@backend: calls}), and the step's
kernel launches by name, for a checkpoint at batch 1 and 64 (tools/profile_step.py has the full trace)."""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dayzero import LLM, SamplingParams
from dayzero.ops import REGISTRY


def main(path: str) -> None:
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=2048,
              kv_cache_gib=8, enable_prefix_caching=False)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    for batch in (1, 64):
        params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", *engine.validate(torch.randint(10, 1000, (128,), generator=g).tolist(), params))
        for _ in range(4):
            engine.step()
        with REGISTRY.record_calls(by_backend=True) as calls:
            engine.step()
        print(f"batch {batch}: ops {dict(sorted(calls.items()))}")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
        rows = sorted(((e.count, e.key) for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
                      reverse=True)
        print(f"batch {batch}: {sum(c for c, _ in rows)} kernels: " + "; ".join(f"{c} {k[:60]}" for c, k in rows[:25]))
        rows = sorted(((e.self_cpu_time_total, e.count, e.key) for e in prof.key_averages()), reverse=True)
        print(f"batch {batch}: host " + "; ".join(f"{k[:40]} {t / 1e3:.1f}ms/{c}" for t, c, k in rows[:25]))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        print(f"batch {batch}: rest {time.perf_counter() - t0:.3f}s")
        for rid in list(engine.tracks):
            engine.pop_finished(rid)


if __name__ == "__main__":
    main(sys.argv[1])
