"""Top-k routing: the Triton kernels (dayzero/kernels/routing/) against the reference ops (PyTorch on
the same GPU), per call, eager and inside a CUDA graph.

    python bench/routing.py                  # every model's routing at T = 1, 128, 8192
    python bench/routing.py --tokens 1 32 --reps 50

Method: "eager" = a loop of --calls calls between two CUDA events (host launch cost included),
"graph" = one replay of a CUDA graph holding --calls calls; both divided by --calls, median of --reps.
Inputs as in tests/kernels/test_routing.py (choice values without near-ties). GB/s counts the logits
read and the ids and weights written once. The hash reference checks ids on the host (a sync), so it
has no graph time. A second table sweeps the kernel's launch configuration (tokens per program,
warps) for DeepSeek-V3 routing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dayzero.ops.registry import REGISTRY  # noqa: E402
from tests.kernels.test_routing import MODEL_CASES  # noqa: E402

CASES = ["deepseek-v3 256/8, 8 groups top-4", "kimi-k2 384/8, one group", "deepseek-v4 256/6 sqrtsoftplus",
         "deepseek-v4 hash 256/6", "gpt-oss 128/4 softmax", "32/4 sigmoid"]


def per_call_us(fn, calls: int, reps: int, graph: bool) -> float:
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(calls):
                fn()
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 8192])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from dayzero.kernels.routing import _topk as routing

    torch.manual_seed(0)
    print(f"{datetime.date.today()}  {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = []
    header = ("| routing | T | kernel eager µs | ref eager µs | kernel graph µs | ref graph µs | ref/kernel (graph) "
              "| kernel GB/s | ids equal | max weight err |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for case in CASES:
        op, make = MODEL_CASES[case]
        kernel, ref = getattr(routing, op), REGISTRY.get(op).reference.fn
        for tokens in args.tokens:
            inputs = make(tokens)
            ids, weights = kernel(*inputs)
            want_ids, want_weights = ref(*inputs)
            err = ((weights - want_weights).abs() / want_weights.abs().clamp_min(1e-6)).max().item()
            k = ids.shape[1]
            nbytes = inputs[0].numel() * inputs[0].element_size() + tokens * k * 12
            t = {name: per_call_us(lambda f=f: f(*inputs), args.calls, args.reps, graph)
                 for name, f, graph in (("kernel_eager", kernel, False), ("ref_eager", ref, False),
                                        ("kernel_graph", kernel, True))}
            t["ref_graph"] = None
            if op != "route_hash":
                try:
                    t["ref_graph"] = per_call_us(lambda: ref(*inputs), args.calls, args.reps, True)
                except RuntimeError as e:  # a reference that cannot be captured
                    print(f"  {case} T={tokens}: reference graph capture failed: {e}", flush=True)
            ratio = f"{t['ref_graph'] / t['kernel_graph']:.1f}x" if t["ref_graph"] else "-"
            ref_graph = f"{t['ref_graph']:.1f}" if t["ref_graph"] else "- (host sync)"
            row = dict(case=case, tokens=tokens, **t, gbps=nbytes / t["kernel_graph"] / 1e3,
                       ids_equal=bool(torch.equal(ids, want_ids)), max_rel_err=err)
            rows.append(row)
            print(f"| {case} | {tokens} | {t['kernel_eager']:.1f} | {t['ref_eager']:.1f} | {t['kernel_graph']:.2f} | "
                  f"{ref_graph} | {ratio} | {row['gbps']:.0f} | {row['ids_equal']} | {err:.1e} |", flush=True)

    print("\nlaunch configuration, deepseek-v3 routing, graph µs per call")
    op, make = MODEL_CASES[CASES[0]]
    sweep = []
    for tokens in (1, 8192):
        logits, bias, top_k, n_group, topk_group, normalize, scaling = make(tokens)
        for block_t in ((1,) if tokens == 1 else (1, 2, 4, 8)):
            for warps in (1, 2, 4):
                us = per_call_us(lambda: routing._launch(logits, top_k, routing.SIGMOID, bias=bias, n_group=n_group,
                                                         topk_group=topk_group, scaling=scaling, block_t=block_t,
                                                         num_warps=warps), args.calls, args.reps, True)
                sweep.append(dict(tokens=tokens, block_t=block_t, num_warps=warps, graph_us=us))
                print(f"  T={tokens:5d} block_t={block_t} warps={warps}: {us:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "sweep": sweep}, indent=1))


if __name__ == "__main__":
    main()
