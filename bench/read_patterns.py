"""Where the one-token decode layer's time goes, by elimination: kernels that only read the gate/up
GEMM's MXFP4 weight words of the active experts in different orders, no decode or arithmetic, timed
against a sequential read of the same number of bytes in the same run (CUDA graphs, weights rotating
over copies far larger than L2, launched with PDL as the decode kernels are).

    python bench/read_patterns.py                   # gpt-oss-120b and DeepSeek-V4 at one token
    python bench/read_patterns.py --per-graph 1 8 --reps 20

Patterns (rows of the table):
- sequential: one contiguous range per program (bench/moe.py's read floor), over the same bytes;
- tiles SxW: the decode GEMM's access pattern (dayzero/kernels/moe_decode.py): program = (pair, 32 gate
  rows and their 32 up rows), K in steps of 512 codes (a 32 x 256-byte piece of each matrix per step,
  the last step overlapping), through Triton's software pipeline with S stages (1: a plain loop), W warps;
- rows: the same programs, but each step reads whole rows (4 gate + 4 up rows, all of K), so that every
  step's bytes are contiguous in memory.

A gap between "tiles" and "sequential" is the cost of the access pattern and of the loads in flight
per program; what "tiles" leaves to the real GEMM is its decode and arithmetic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import MODELS, copy_bandwidth, graph_replay_us, read_floor_us  # noqa: E402
from dayzero.kernels import pdl  # noqa: E402


@triton.jit
def _tiles_kernel(w_ptr, ids_ptr, out_ptr, K: tl.constexpr, NW: tl.constexpr, OUT_N: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program (pair, n tile): rows n0.. and OUT_N + n0.. of the pair's expert, K tiles of BLOCK_K codes."""
    pdl.start(PDL)
    expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    base = w_ptr + expert * (NW * (K // 8))
    rows = n0 + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.int32)
    for step in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        start = tl.minimum(step, K - BLOCK_K) // 8
        g = tl.load(base + rows[:, None] * (K // 8) + start + cols[None, :])
        u = tl.load(base + (OUT_N + rows)[:, None] * (K // 8) + start + cols[None, :])
        acc ^= g ^ u
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.xor_sum(acc, 1), 0))


@triton.jit
def _rows_kernel(w_ptr, ids_ptr, out_ptr, K: tl.constexpr, NW: tl.constexpr, OUT_N: tl.constexpr,
                 BLOCK_N: tl.constexpr, ROWS: tl.constexpr, KP: tl.constexpr, STAGES: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (pair, n tile) as _tiles_kernel, each step ROWS whole rows of each matrix (K padded to KP)."""
    pdl.start(PDL)
    expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    base = w_ptr + expert * (NW * (K // 8))
    cols = tl.arange(0, KP // 8)
    mask = (cols < K // 8)[None, :]
    acc = tl.zeros([ROWS, KP // 8], tl.int32)
    for r in tl.range(0, BLOCK_N, ROWS, num_stages=STAGES):
        rows = n0 + r + tl.arange(0, ROWS)
        g = tl.load(base + rows[:, None] * (K // 8) + cols[None, :], mask=mask, other=0)
        u = tl.load(base + (OUT_N + rows)[:, None] * (K // 8) + cols[None, :], mask=mask, other=0)
        acc ^= g ^ u
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.xor_sum(acc, 1), 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--per-graph", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/read_patterns.py needs a CUDA device")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    dev = torch.device("cuda")
    lines = ["| model | pattern | per graph | µs per kernel | % copy BW | sequential / this |", "|---|---|---|---|---|---|"]
    for name in args.models:
        E, k, H, I, _, _ = MODELS[name]
        words = [torch.randint(-2**31, 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, device=dev)
                 for _ in range(args.copies)]
        ids = torch.randperm(E, device=dev)[:k].to(torch.int32)  # one token's experts
        nbytes = k * 2 * I * H // 2
        out = torch.empty(k * I // 8, dtype=torch.int32, device=dev)
        opts = pdl.launch_options(dev)

        def tiles(stages, warps):
            return lambda s: _tiles_kernel[(k, I // 32)](words[s], ids, out, K=H, NW=2 * I, OUT_N=I, BLOCK_N=32,
                                                         BLOCK_K=512, STAGES=stages, num_warps=warps, **opts)

        def rows(stages, warps):
            return lambda s: _rows_kernel[(k, I // 32)](words[s], ids, out, K=H, NW=2 * I, OUT_N=I, BLOCK_N=32,
                                                        ROWS=4, KP=triton.next_power_of_2(H), STAGES=stages,
                                                        num_warps=warps, **opts)

        patterns = {"tiles 3x8": tiles(3, 8), "tiles 3x4": tiles(3, 4), "tiles 1x8": tiles(1, 8),
                    "tiles 4x8": tiles(4, 8), "rows 3x8": rows(3, 8), "rows 1x8": rows(1, 8)}
        for per_graph in args.per_graph:
            seq = read_floor_us(nbytes, args.reps, args.copies, per_graph)
            results = {"sequential": seq}
            for label, fn in patterns.items():
                results[label] = graph_replay_us(fn, args.copies, args.reps, per_graph)
            for label, us in results.items():
                pct = 100 * nbytes / (us * 1e-6) / bw
                line = f"| {name} | {label} | {per_graph} | {us:.1f} | {pct:.1f}% | {seq / us:.2f} |"
                lines.append(line)
                print(line, flush=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
