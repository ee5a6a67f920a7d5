"""The cost of the tensor/expert-parallel communication on one GPU: NCCL at world size 1.

    python bench/collectives.py --model /tmp/gpt-oss-20b --make     # writes the random checkpoint first if absent
    python bench/collectives.py --no-e2e                            # the collectives alone

A process that joins a job of one (dayzero.parallel.init_process(1, 1, ...)) runs every collective of the
split code paths for real: the row-parallel projections' and the experts' all-reduce, the vocabulary-
parallel embedding's all-reduce and the lm_head's all-gather (dayzero/models/sharded.py). Measured here:
  the collectives alone: median time of one NCCL all_reduce of [B, hidden] bf16 and one all_gather of
      [B, vocab] bf16 logits, launched eagerly (per call, over 200 calls) and replayed inside a CUDA graph
      of 100 calls (what a decode step's graph pays), B = 1, 64, 256;
  end to end (bench/e2e.py's decode step, CUDA graphs + async scheduling, 128-token prompts): the
      decode step at batch 1 and 64 of the unjoined engine, then of the same engine joined at world size 1,
      and whether the two give the same greedy tokens. The difference is what the communication costs a
      step on one GPU (gpt-oss: 2 all-reduces per layer, the embedding's and the lm_head's).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRAPH_CALLS = 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eager_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _graph_us(fn) -> float:
    """One call's time inside a captured graph of GRAPH_CALLS calls (median of 20 replays)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / GRAPH_CALLS * 1e6


def collective_numbers(hidden: int, vocab: int) -> dict:
    out = {}
    for b in (1, 64, 256):
        x = torch.randn(b, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(b, vocab, device="cuda", dtype=torch.bfloat16)
        pieces = [torch.empty_like(logits)]
        reduce_ = lambda: dist.all_reduce(x)  # noqa: E731
        gather = lambda: dist.all_gather(pieces, logits)  # noqa: E731
        out[f"all_reduce_b{b}"] = {"eager_us": _eager_us(reduce_), "graph_us": _graph_us(reduce_)}
        out[f"all_gather_b{b}"] = {"eager_us": _eager_us(gather), "graph_us": _graph_us(gather)}
        print(f"  B={b}: all_reduce [{b}, {hidden}] eager {out[f'all_reduce_b{b}']['eager_us']:.1f} us, in a graph "
              f"{out[f'all_reduce_b{b}']['graph_us']:.2f} us; all_gather [{b}, {vocab}] eager "
              f"{out[f'all_gather_b{b}']['eager_us']:.1f} us, in a graph {out[f'all_gather_b{b}']['graph_us']:.2f} us",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/gpt-oss-20b"))
    ap.add_argument("--make", action="store_true", help="write the gpt-oss-20b-shaped checkpoint if absent")
    ap.add_argument("--no-e2e", action="store_true", help="the collectives alone")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from dayzero.parallel import current, init_process, shutdown

    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    e2e_args = argparse.Namespace(budget=8192, kv_gib=8.0, long_only=False, steps=args.steps, long_decode=0)
    if not args.no_e2e:
        from bench.e2e import dayzero_numbers

        if args.make and not (args.model / "config.json").exists():
            from bench.checkpoints import write_checkpoint

            write_checkpoint("gpt-oss-20b", args.model, "cuda")
        config = json.loads((args.model / "config.json").read_text())
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        print("unjoined (no process group: every collective is skipped)", flush=True)
        result["unjoined"] = dayzero_numbers(args.model, e2e_args, vocab, "async", [])
    else:
        hidden, vocab = 2880, 201088  # gpt-oss-20b
    init_process(1, 1, 0, f"tcp://127.0.0.1:{_free_port()}", "cuda:0")
    try:
        assert current().backend == "nccl" and current().tp_group is not None
        print(f"NCCL, world size 1: the collectives alone (hidden {hidden}, vocab {vocab})", flush=True)
        result["collectives"] = collective_numbers(hidden, vocab)
        if not args.no_e2e:
            calls = {"all_reduce": 0, "all_gather": 0}
            originals = {name: getattr(dist, name) for name in calls}

            def counted(name):
                def call(*a, **k):
                    calls[name] += 1
                    return originals[name](*a, **k)
                return call
            for name in calls:
                setattr(dist, name, counted(name))
            print("joined at world size 1 (every collective runs)", flush=True)
            result["joined"] = dayzero_numbers(args.model, e2e_args, vocab, "async", [])
            for name, fn in originals.items():
                setattr(dist, name, fn)
            result["collective_calls_while_capturing_and_eager"] = calls
            u, j = result["unjoined"], result["joined"]
            result["same_greedy_tokens"] = u["greedy_tokens"] == j["greedy_tokens"]
            for b in (1, 64):
                print(f"decode step at batch {b}: unjoined {u[f'decode_b{b}'] * 1e3:.3f} ms, joined "
                      f"{j[f'decode_b{b}'] * 1e3:.3f} ms (+{(j[f'decode_b{b}'] - u[f'decode_b{b}']) * 1e3:.3f} ms)")
            print(f"same greedy tokens: {result['same_greedy_tokens']}; collective calls (Python side) {calls}")
    finally:
        shutdown()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
