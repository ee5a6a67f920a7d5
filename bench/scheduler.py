"""CPU overhead of the engine's bookkeeping per step, with 256 concurrent requests.

Measures, in one run, per decode step of 256 running requests: the scheduler (schedule + update:
block allocation, token accounting, stop checks), the batched sampler (greedy and top-p at the
demo model's vocabulary), detokenization with stop-string checks, and, as the baseline the
bookkeeping is weighed against, the model forward of the same step on the demo model through the
current runner (one forward per request). Prints a table of microseconds per step and the ratio of
each part to the model step.

    python bench/scheduler.py [--requests 256] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dayzero.cache import BlockPool, KVCacheManager
from dayzero.engine import Request, SamplingParams, Scheduler
from dayzero.engine.llm import LLM
from dayzero.engine.sampling import Sampler, StopChecker


def timed(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    n, steps = args.requests, args.steps

    llm = LLM()  # the demo model: its vocabulary and tokenizer
    vocab = llm.vocab_size

    # scheduler + KV bookkeeping alone, 256 requests in decode
    kv = KVCacheManager(BlockPool(n * 64), block_size=16, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=n, max_num_batched_tokens=n * args.prompt_len)
    params = SamplingParams(max_tokens=16 * 64 - args.prompt_len, ignore_eos=True)  # fits 64 blocks each
    for i in range(n):
        sched.add(Request(f"r{i}", torch.randint(0, vocab, (args.prompt_len,)).tolist(), params))
    out = sched.schedule()  # the whole prefill in one step
    sched.update(out, {s.request.request_id: 1 for s in out.scheduled})

    def scheduler_step():
        o = sched.schedule()
        sched.update(o, {s.request.request_id: 7 for s in o.scheduled})

    sched_us = timed(scheduler_step, steps)

    logits = torch.randn(n, vocab)
    sampler = Sampler(vocab)
    greedy_states = [sampler.new_state(SamplingParams(temperature=0.0), [1, 2, 3]) for _ in range(n)]
    topp_states = [sampler.new_state(SamplingParams(temperature=0.8, top_p=0.9, seed=i), [1, 2, 3]) for i in range(n)]
    greedy_us = timed(lambda: sampler(logits, greedy_states), steps)
    topp_us = timed(lambda: sampler(logits, topp_states), steps)

    checkers = [StopChecker(SamplingParams(stop=["\n\n", "###"]), {2}) for _ in range(n)]
    outputs = [torch.randint(3, vocab, (40,)).tolist() for _ in range(n)]

    def detok_step():
        for checker, ids in zip(checkers, outputs):
            text = llm.tokenizer.decode(ids, skip_special_tokens=True)
            checker.check(text, ids[-1], len(ids))

    detok_us = timed(detok_step, max(3, steps // 4))

    # baseline: the model's decode step for the same 256 requests through the current runner
    model = llm.model
    caches = []
    with torch.no_grad():
        for _ in range(n):
            cache = model.new_cache(1)
            ids = torch.randint(0, vocab, (1, args.prompt_len))
            model(ids, torch.arange(args.prompt_len)[None], cache)
            caches.append(cache)

    def model_step():
        with torch.no_grad():
            for cache in caches:
                model(torch.tensor([[5]]), torch.tensor([[cache.length]]), cache)

    model_us = timed(model_step, 3)

    rows = [
        ("scheduler schedule + update", sched_us),
        ("sampler, greedy", greedy_us),
        ("sampler, temperature + top-p, seeded", topp_us),
        ("detokenize + stop strings", detok_us),
        ("model decode step (baseline)", model_us),
    ]
    print(f"{n} concurrent requests in decode, prompt {args.prompt_len} tokens, vocab {vocab}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'part':<40} {'us/step':>12} {'us/request':>12} {'vs model step':>14}")
    for name, us in rows:
        print(f"{name:<40} {us:>12.0f} {us / n:>12.2f} {us / model_us:>13.1%}")


if __name__ == "__main__":
    main()
