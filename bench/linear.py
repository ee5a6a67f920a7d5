"""FP8 block-scaled projections (linear_fp8_block) on the H200 at DeepSeek-V3.2's shapes: our kernel (the
path it chooses, and each path pinned: the fused GEMM, dequantize + cuBLAS), the reference op (the whole
weight dequantized through float32 at every call, what ran before), and cuBLAS on a bf16 copy of the
weight (what holding the weights in bf16 would cost: twice the memory), in one run.

    python bench/linear.py            # every shape at 1, 16, 64, 256, 1024, 8192 rows
    python bench/linear.py --quick    # 1, 64, 1024 rows

µs per call from CUDA-graph replays, rotating over weight copies that together exceed L2. Roofline: the
FP8 weight bytes (and the activations) against the measured copy bandwidth, or the FLOPs against the
measured bf16 matmul rate, whichever is longer."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import copy_bandwidth, graph_replay_us, matmul_rate  # noqa: E402
from dayzero import settings  # noqa: E402
from dayzero.formats.fp8 import dequantize_weight_blocks  # noqa: E402
from dayzero.kernels.linear._fp8_block import choose  # noqa: E402
from dayzero.ops.linear import linear_fp8_block  # noqa: E402
from dayzero.ops.registry import REGISTRY  # noqa: E402

# (name, N, K): DeepSeek-V3.2's projections (hidden 7168, q_lora 1536, 128 heads, dense MLP 18432)
SHAPES = [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("o_proj", 7168, 16384), ("mlp gate", 18432, 7168),
          ("mlp down", 7168, 18432)]
L2_BYTES = 60 * 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    rows_list = (1, 64, 1024) if args.quick else (1, 16, 64, 256, 1024, 8192)
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s",
          flush=True)
    head = ("| shape (N x K) | rows | ours µs (path) | fused µs | dequant + cuBLAS µs | reference µs "
            "| cuBLAS bf16 µs | roofline µs | roof / ours |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        copies = max(1, -(-2 * L2_BYTES // (n * k)))
        ws = [torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(copies)]
        ss = [torch.rand(-(-n // 128), -(-k // 128), device="cuda", generator=g) * 0.02 for _ in range(copies)]
        wb = [dequantize_weight_blocks(w, s, (128, 128), torch.bfloat16) for w, s in zip(ws, ss)]
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            want = F.linear(x, wb[0])
            with REGISTRY.record_calls(by_backend=True) as calls:
                got = linear_fp8_block(x, ws[0], ss[0])
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            assert err < 2**-6, f"{name} x {m}: relative error {err}"
            ours = graph_replay_us(lambda i: linear_fp8_block(x, ws[i], ss[i]), copies, args.reps)
            pinned = {}
            for path in ("fused", "dequant"):
                with settings.override(variants={"linear_fp8_block": path}):
                    pinned[path] = graph_replay_us(lambda i: linear_fp8_block(x, ws[i], ss[i]), copies, args.reps)
            with REGISTRY.force_backend("reference"):
                ref = graph_replay_us(lambda i: linear_fp8_block(x, ws[i], ss[i]), copies, min(args.reps, 10))
            cublas = graph_replay_us(lambda i: F.linear(x, wb[i]), copies, args.reps)
            roof = 1e6 * max((n * k + 2 * m * (n + k)) / bw, 2 * m * n * k / rate)
            rows.append(f"| {name} ({n} x {k}) | {m} | {ours:.1f} ({choose(m)}) | {pinned['fused']:.1f} | "
                        f"{pinned['dequant']:.1f} | {ref:.1f} | {cublas:.1f} | {roof:.1f} | {roof / ours:.0%} |")
            print(rows[-1], f"  backends: {', '.join(sorted(calls))}", flush=True)
        del ws, ss, wb
        torch.cuda.empty_cache()
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
