"""CPU overhead of the engine's bookkeeping per step, with 256 concurrent requests.

Measures, in one run, per decode step of 256 running requests: the scheduler (schedule + update:
block allocation, token accounting, stop checks), the paged runner's step metadata (`build_step`:
slot mapping and right-aligned read indices of every cache group and entry rate, from the block
tables), the batched sampler (greedy and top-p at the demo model's vocabulary), detokenization with
stop-string checks, and, as the baseline the bookkeeping is weighed against, the model forwards of
the same step on the demo model through the engine's paged runner (DeepSeek-V4 decodes one row per
forward), and the whole engine step; also, for 256 sequences of 4K tokens, the decode graphs' metadata
fill (StaticStep.fill) and build_step with its tables converted afresh and through the runner's
HostTables (incrementally). Prints a table of microseconds per step and the ratio of each
part to the model step.

    python bench/scheduler.py [--requests 256] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dayzero.cache import BlockPool, KVCacheManager
from dayzero.engine import Request, SamplingParams, Scheduler
from dayzero.engine.detokenizer import IncrementalDetokenizer
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

    checkers = [StopChecker(SamplingParams(stop=["\n\n", "###"], max_tokens=None), {2}) for _ in range(n)]
    outputs = [torch.randint(3, vocab, (40,)).tolist() for _ in range(n)]
    detoks = [IncrementalDetokenizer(llm.tokenizer, ids) for ids in outputs]

    def detok_step():  # one new token per request, detokenized incrementally, then the stop check
        for checker, ids, detok in zip(checkers, outputs, detoks):
            ids.append(int(torch.randint(3, vocab, ())))
            checker.check(detok.step(), ids[-1], len(ids))

    detok_us = timed(detok_step, max(3, steps // 4))

    # baseline: the demo model's decode step for 256 requests through the engine (paged runner)
    from dayzero.cache.step import SeqStep, build_step

    engine = LLM(max_num_seqs=n, max_num_batched_tokens=n * args.prompt_len, kv_cache_gib=1.0).engine
    decode = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"r{i}", torch.randint(0, vocab, (args.prompt_len,)).tolist(), decode)
    engine.step()  # every prefill in one step
    runner, kv = engine.runner, engine.scheduler.kv
    forward_us: list[float] = []
    execute = runner.execute

    def timed_execute(output):
        t0 = time.perf_counter()
        result = execute(output)
        forward_us.append((time.perf_counter() - t0) * 1e6)
        return result

    runner.execute = timed_execute
    engine_us = timed(engine.step, 3)
    model_us = statistics.median(forward_us)
    rids = [f"r{i}" for i in range(n)]
    tables = [kv.block_tables[r] for r in rids]
    starts = [engine.tracks[r].request.num_computed_tokens for r in rids]
    slots = [runner.slots[r] for r in rids]
    layout = runner.storage.layout
    seq_steps = [SeqStep(start, 1, table, slot, True, [1]) for start, table, slot in zip(starts, tables, slots)]
    metadata_us = timed(lambda: build_step(seq_steps, layout, kv.block_size, "cpu"), steps)

    # the decode graphs' metadata (StaticStep.fill) for a gpt-oss-like layout (a full and a window group)
    from dayzero.cache.layout import CacheLayout, StreamSpec
    from dayzero.cache.static_step import StaticStep

    graph_layout = CacheLayout([StreamSpec(0, "k", (8, 64), torch.bfloat16, None, 1),
                                StreamSpec(1, "k", (8, 64), torch.bfloat16, 128, 1)], [])
    static = StaticStep(graph_layout, 16, n, 16 * 1024, [0, 0], 0, "cpu")
    per_seq = 4096 // 16 + 1  # 4K-token contexts
    graph_steps = [SeqStep(4096, 1, [list(range(i * per_seq, (i + 1) * per_seq))] * 2, i, True, [1]) for i in range(n)]
    static.fill(graph_steps, n)  # the first fill writes whole rows; later ones only new tails
    static_us = timed(lambda: static.fill(graph_steps, n), steps)
    from collections import defaultdict

    from dayzero.cache.step import HostTables

    host = defaultdict(HostTables)
    build_step(graph_steps, graph_layout, 16, "cpu", host)  # the first call converts whole tables
    fresh_us = timed(lambda: build_step(graph_steps, graph_layout, 16, "cpu"), steps)
    incremental_us = timed(lambda: build_step(graph_steps, graph_layout, 16, "cpu", host), steps)

    rows = [
        ("scheduler schedule + update", sched_us),
        ("step metadata (build_step, all groups)", metadata_us),
        ("graph metadata (StaticStep.fill, 4K)", static_us),
        ("build_step, 4K ctx, tables afresh", fresh_us),
        ("build_step, 4K ctx, HostTables", incremental_us),
        ("sampler, greedy", greedy_us),
        ("sampler, temperature + top-p, seeded", topp_us),
        ("detokenize + stop strings", detok_us),
        ("model decode step (baseline)", model_us),
        ("whole engine step", engine_us),
    ]
    print(f"{n} concurrent requests in decode, prompt {args.prompt_len} tokens, vocab {vocab}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'part':<40} {'us/step':>12} {'us/request':>12} {'vs model step':>14}")
    for name, us in rows:
        print(f"{name:<40} {us:>12.0f} {us / n:>12.2f} {us / model_us:>13.1%}")


if __name__ == "__main__":
    main()
