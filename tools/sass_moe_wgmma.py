"""Compile the Gluon prefill GEMM (dayzero/kernels/moe/_wgmma.py) for sm_90 on a machine without a GPU and
report what the H200 would run: shared memory, registers, spills, and the SASS opcodes of the K loop
(the loop that issues HGMMA). Costs no device time; uses the ptxas and cuobjdump bundled with Triton.

    python tools/sass_moe_wgmma.py --k 2880 --gated --bt 128            # gpt-oss gate/up
    python tools/sass_moe_wgmma.py --k 2048 --bt 256 --stages 3 --dump out.sass

Compiling at all checks the upcast: the kernel converts it to the wgmma operand layout with
assert_trivial, so a layout that needed data movement fails here.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from dayzero.kernels.moe import _wgmma as moe_wgmma  # noqa: E402
from tools.sass_moe_mma import report  # noqa: E402

ARGS = [("w_ptr", "*i32"), ("s_ptr", "*u8"), ("bias_ptr", "*bf16"), ("out_ptr", "*bf16"), ("row_pair_ptr", "*i32"),
        ("block_expert_ptr", "*i32"), ("block_row_ptr", "*i32"), ("block_end_ptr", "*i32"), ("router_weight_ptr", "*fp32"), ("N", "i32"), ("S", "i32"), ("E", "i32"),
        ("num_blocks", "i32"), ("up_offset", "i32"), ("alpha", "fp32"), ("limit", "fp32"), ("stride_we", "i64"),
        ("stride_wn", "i32"), ("stride_se", "i32"), ("stride_sn", "i32"), ("stride_be", "i32"), ("stride_om", "i32")]
ALIGNED = {"N", "w_ptr", "s_ptr", "bias_ptr", "out_ptr", "row_pair_ptr", "block_expert_ptr", "block_row_ptr",
           "block_end_ptr", "router_weight_ptr",
           "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_om"}


def compile_variant(k: int, gated: bool, bt: int, stages: int, high: bool, pipeline: bool = False,
                    scheduled: bool = False):
    layout = gl.NVMMASharedLayout.get_default_for([bt, moe_wgmma.BLOCK_K], gl.bfloat16)
    sig = {"x_desc": f"tensordesc<bf16[{bt}, {moe_wgmma.BLOCK_K}],{layout!r}>", **dict(ARGS)}
    consts = dict(K=k, GATED=gated, ACTIVATION=2 if gated else 0, HAS_LIMIT=gated, HAS_BIAS=True,
                  ROUTER_WEIGHT=not gated, PERMUTE_OUT=gated, HIGH_SCALES=high, BLOCK_T=bt, STAGES=stages, GROUP_M=8,
                  PIPELINE=pipeline, SCHEDULED=scheduled,
                  num_warps=moe_wgmma.NUM_WARPS)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    src = GluonASTSource(fn=moe_wgmma._wgmma_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=moe_wgmma.NUM_WARPS))


def mma_loop_opcodes(sass: str) -> tuple[collections.Counter, int]:
    """Opcode counts of the innermost loop that contains HGMMA (a backward branch and its target)."""
    lines = sass.splitlines()
    addr, ops_at = {}, {}
    for i, line in enumerate(lines):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            addr[int(m.group(1), 16)] = i
            ops_at[i] = m.group(2)
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?.*?0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16) and int(m.group(2), 16) in addr:
            start = addr[int(m.group(2), 16)]
            if any(ops_at.get(j) == "HGMMA" for j in range(start, i)) and (best is None or i - start < best[1] - best[0]):
                best = (start, i)
    ops = collections.Counter()
    if best:
        for j in range(best[0], best[1] + 1):
            if j in ops_at:
                ops[ops_at[j]] += 1
    return ops, sum(ops.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, required=True, help="the GEMM's K (hidden for gate/up, intermediate for down)")
    ap.add_argument("--gated", action="store_true", help="the gate/up GEMM (activation, permuted h)")
    ap.add_argument("--bt", type=int, default=128, help="padded rows per program")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--low", action="store_true", help="one bf16 multiply per pair (no scale bytes above 128)")
    ap.add_argument("--pipeline", action="store_true", help="two register sets, one wgmma in flight (PIPELINE)")
    ap.add_argument("--scheduled", action="store_true", help="blocks from a BlockList (split_blocks)")
    ap.add_argument("--dump", type=Path, help="write the whole SASS here")
    args = ap.parse_args()
    compiled = compile_variant(args.k, args.gated, args.bt, args.stages, not args.low, args.pipeline, args.scheduled)
    report(compiled, mma_loop_opcodes, args.dump, 40)

if __name__ == "__main__":
    main()
