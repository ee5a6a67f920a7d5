"""One run of tests/engine/test_oom_cuda.py, in a process of its own: an engine on the GPU (float32, a KV
pool that holds half the burst, prefix caching off) generates 8 greedy tokens for each of a burst of
3000-token prompts, optionally with the caching allocator capped at --cap-mib above what it reserved once
the engine was built; writes the outputs, the OOM counters and how far the burst grew reserved memory
(bytes) as JSON.

    python -m tests.engine.oom_cuda_run demo /tmp/run.json --budget 16384 --burst 8 --cap-mib 90
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

BUDGET = 16384  # tokens per step (--chunked-prefill-size)
PROMPT, BURST = 3000, 8  # a burst of 8 prompts of 3000 tokens: 24000 prompt tokens, steps of the whole budget
MIB = 2**20


def main() -> None:
    from dayzero.engine import SamplingParams
    from dayzero.engine.llm import LLM
    from tests.engine.test_llm import _prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a checkpoint directory or 'demo'")
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", type=int, default=BUDGET)
    ap.add_argument("--burst", type=int, default=BURST)
    ap.add_argument("--cap-mib", type=float, default=0.0, help="cap reserved memory this far above the built engine's")
    args = ap.parse_args()
    llm = LLM(None if args.model == "demo" else args.model, device="cuda", dtype="float32",
              max_num_batched_tokens=args.budget, max_num_seqs=BURST, max_model_len=4096,
              num_kv_blocks=BURST * PROMPT // 16 // 2,  # half the burst fits
              enable_prefix_caching=False)
    prompts = _prompts(llm.vocab_size, [PROMPT] * BURST, seed=3)[:args.burst]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    torch.cuda.synchronize()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if args.cap_mib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((reserved + args.cap_mib * MIB) / total)
    try:
        outs = llm.generate(prompts, params)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.synchronize()
    engine, sched, kv = llm.engine, llm.scheduler, llm.scheduler.kv
    args.out.write_text(json.dumps(dict(
        grown=torch.cuda.max_memory_reserved() - reserved, reserved=reserved,
        allocated_before=allocated, allocated_after=torch.cuda.memory_allocated(),
        tokens=[o.token_ids for o in outs], logprobs=[[lp.logprob for lp in o.outputs[0].logprobs] for o in outs],
        finish=[o.finish_reason for o in outs], oom_retries=engine.num_oom_retries,
        failed_steps=engine.num_failed_steps, token_budget=sched.token_budget, preemptions=sched.num_preemptions,
        **{"async": engine.async_scheduling},
        pool_free=all(p.num_free == p.num_blocks for p in kv.pools) and not kv.block_tables
        and not llm.runner.num_requests and not engine.tracks)))


if __name__ == "__main__":
    main()
