"""Compile a Gluon decode GEMM of path A (dayzero/kernels/moe/_decode_sm90.py) for sm_90 on a machine without
a GPU and report its registers, spills, shared memory, CTA barriers and the SASS opcodes per weight word
(the K loop is unrolled: the whole kernel's count, prologue and epilogue included). Costs no device time;
uses the ptxas and cuobjdump that Triton's wheel bundles (see sass_moe_mma.py).

    python tools/sass_moe_decode_sm90.py --k 2880 --gated --tile 32x256x8 --stages 3   # gpt-oss gate/up
    python tools/sass_moe_decode_sm90.py --k 2880 --tile 32x512x8 --stages 4           # its down GEMM
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
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from dayzero.kernels.moe import _decode_sm90 as moe_decode_sm90  # noqa: E402
from tools.sass_moe_mma import disassemble  # noqa: E402


def compile_gemm(k: int, out_n: int, gated: bool, tile: tuple[int, int, int], stages: int, normal: bool):
    """The Gluon decode GEMM as decode_gemm_sm90 launches it (biases, gpt-oss's clamped activation when
    gated, PDL) for sm_90."""
    bn, bk, warps = tile
    args = [("xq_ptr", "*i32"), ("xs_ptr", "*fp32"), ("w_ptr", "*i32"), ("s_ptr", "*u8"), ("bias_ptr", "*bf16"),
            ("out_ptr", "*i32" if gated else "*fp32"), ("out_s_ptr", "*fp32"), ("ids_ptr", "*i64"),
            ("router_weight_ptr", "*fp32"), ("S", "i32"), ("E", "i32"), ("stride_be", "i32"), ("alpha", "fp32"),
            ("limit", "fp32")]
    sig = dict(args)
    consts = dict(K=k, NW=2 * out_n if gated else out_n, OUT_N=out_n, TOP_K=4, GATHER=gated,
                  ACTIVATION=2 if gated else 0, HAS_LIMIT=gated, HAS_BIAS=True, ROUTER_WEIGHT=not gated, BLOCK_N=bn,
                  BLOCK_K=min(bk, 1 << (k.bit_length() - 1)), STAGES=stages, NORMAL=normal, PDL=True,
                  num_warps=warps)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, _ in args if n.endswith("_ptr")}
    src = GluonASTSource(fn=moe_decode_sm90._decode_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def report(compiled, k: int, gated: bool, tile: tuple[int, int, int], dump: Path | None = None) -> dict:
    bn, bk, warps = tile
    bk = min(bk, 1 << (k.bit_length() - 1))
    usage, sass = disassemble(compiled, dump)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(2)] += 1
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    steps = -(-k // bk)
    words = steps * (2 if gated else 1) * bn * bk // 8 / (32 * warps)  # weight words one thread decodes
    return dict(registers=int(regs.group(1)), stack=int(regs.group(2)), ops=ops, total=sum(ops.values()),
                words=words)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, required=True, help="the GEMM's K (hidden for gate/up, intermediate for down)")
    ap.add_argument("--out", type=int, default=2880, help="outputs (intermediate for gate/up, hidden for down)")
    ap.add_argument("--gated", action="store_true", help="the gate/up GEMM (gate and up rows, activation)")
    ap.add_argument("--tile", required=True, help="BLOCK_NxBLOCK_KxWARPS, e.g. 32x256x8")
    ap.add_argument("--stages", type=int, default=3, help="n ring slots: n - 1 weight tiles in flight")
    ap.add_argument("--normal", action="store_true", help="the one-shift E8M0 factors (scale bytes in 1..254)")
    ap.add_argument("--dump", type=Path, help="write the SASS there")
    args = ap.parse_args()
    tile = tuple(int(v) for v in args.tile.split("x"))
    compiled = compile_gemm(args.k, args.out, args.gated, tile, args.stages, args.normal)
    r = report(compiled, args.k, args.gated, tile, args.dump)
    per = {op: n / r["words"] for op, n in r["ops"].items()}
    print(f"shared {compiled.metadata.shared} B, registers {r['registers']}, stack (spills) {r['stack']} B, "
          f"CTA barriers {r['ops'].get('BAR', 0)}; {r['total']} instructions per thread, {r['words']:g} weight "
          f"words each: {r['total'] / r['words']:.1f} per word")
    print("  per word: " + ", ".join(f"{op} {v:.2f}" for op, v in sorted(per.items(), key=lambda t: -t[1])[:14]))


if __name__ == "__main__":
    main()
