"""Compile a decode GEMM of path A (dayzero/kernels/moe/_decode.py) for sm_90 on a machine without a GPU and
report its registers, spills and the SASS opcodes of its main loop per weight word each thread decodes.
Costs no device time; uses the ptxas and cuobjdump that Triton's wheel bundles (see sass_moe_mma.py).

    python tools/sass_moe_decode.py --k 2880 --gated --tile 1x32x512x8 --stages 3 --pdl   # gpt-oss gate/up, one token
    python tools/sass_moe_decode.py --k 2880 --tile 1x32x1024x8 --early --pdl              # its down GEMM
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tools.sass_moe_mma import disassemble, loop_opcodes  # noqa: E402

TYPES = {"xq_ptr": "*i32", "xs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8", "bias_ptr": "*bf16",
         "out_s_ptr": "*fp32", "row_pair_ptr": "*i32", "block_expert_ptr": "*i32", "router_weight_ptr": "*fp32",
         "S": "i32", "E": "i32", "stride_be": "i32", "alpha": "fp32", "limit": "fp32"}


def compile_decode(k: int, out_n: int, gated: bool, tile: tuple[int, int, int, int], module=None, stages: int = 0,
                   early: bool = False, pdl: bool = False, normal: bool = False):
    """The decode GEMM as decode_gemm launches it (biases, gpt-oss's clamped activation when gated) for
    sm_90; `module` defaults to dayzero.kernels.moe._decode (another version's file can be passed to
    compare, if its kernel has the same arguments); stages: 0 the register prefetch, n >= 2 the software-
    pipelined loop; early: the pair-order dispatch, the prefetched tiles loaded before the PDL wait (pdl:
    compiled with the wait); normal: the one-shift E8M0 factors (every scale byte in 1..254)."""
    if module is None:
        from dayzero.kernels.moe import _decode as module
    kernel = module._moe_decode_kernel
    bm, bn, bk, warps = tile
    consts = dict(K=k, NW=2 * out_n if gated else out_n, OUT_N=out_n, GATHER=gated, TOP_K=4,
                  ACTIVATION=2 if gated else 0, HAS_LIMIT=gated, HAS_BIAS=True, ROUTER_WEIGHT=not gated,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(bk, 1 << (k.bit_length() - 1)), USE_ASM=True, STAGES=stages,
                  PAIR_ORDER=early, EARLY=early, PDL=pdl, NORMAL_SCALES=normal)
    sig = {}
    for param in kernel.params:  # in the kernel's order; constexprs not given at their defaults
        if param.is_constexpr:
            if param.name not in consts:
                consts[param.name] = param.default
            sig[param.name] = "constexpr"
        else:
            sig[param.name] = "*i32" if param.name == "out_ptr" and gated else "*fp32" if param.name == "out_ptr" \
                else TYPES[param.name]
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))


def report(compiled, k: int, gated: bool, tile: tuple[int, int, int, int], dump: Path | None = None) -> dict:
    """Registers, spills and the main loop's opcodes; words = weight words one thread decodes per K step."""
    bm, bn, bk, warps = tile
    bk = min(bk, 1 << (k.bit_length() - 1))
    usage, sass = disassemble(compiled, dump)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    ops, total = loop_opcodes(sass)
    words = (2 if gated else 1) * bn * bk // 8 / (32 * warps)
    return dict(registers=int(regs.group(1)), stack=int(regs.group(2)), ops=ops, total=total, words=words)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, required=True, help="the GEMM's K (hidden for gate/up, intermediate for down)")
    ap.add_argument("--out", type=int, default=2880, help="outputs (intermediate for gate/up, hidden for down)")
    ap.add_argument("--gated", action="store_true", help="the gate/up GEMM (gate and up rows, activation)")
    ap.add_argument("--tile", required=True, help="BLOCK_MxBLOCK_NxBLOCK_KxWARPS, e.g. 1x64x256x8")
    ap.add_argument("--stages", type=int, default=0, help="0: register prefetch; n >= 2: the pipelined loop")
    ap.add_argument("--early", action="store_true", help="tiles loaded before the PDL wait (pair order, stages 0)")
    ap.add_argument("--pdl", action="store_true", help="compile the PDL wait in")
    ap.add_argument("--normal", action="store_true", help="the one-shift E8M0 factors (scale bytes in 1..254)")
    ap.add_argument("--dump", type=Path, help="write the SASS of this tree's kernel there")
    ap.add_argument("--compare", type=Path, help="another version of _decode.py to report beside this one")
    args = ap.parse_args()
    tile = tuple(int(v) for v in args.tile.split("x"))
    versions = [("this tree", None)]
    if args.compare:
        import importlib.util
        spec = importlib.util.spec_from_file_location("decode_compare", args.compare)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        versions.append((str(args.compare), mod))
    int_ops = ("PRMT", "LOP3", "SHF", "IADD3", "IMAD", "LEA", "ISETP", "SEL", "IDP", "I2F", "IMNMX")
    for name, mod in versions:
        mine = mod is None
        compiled = compile_decode(args.k, args.out, args.gated, tile, mod, args.stages,
                                  args.early and mine, args.pdl and mine, args.normal and mine)
        r = report(compiled, args.k, args.gated, tile, args.dump if mine else None)
        per = {op: n / r["words"] for op, n in r["ops"].items()}
        ints = sum(v for op, v in per.items() if op.startswith(int_ops))
        print(f"{name}: shared {compiled.metadata.shared} B, registers {r['registers']}, stack (spills) {r['stack']} B; "
              f"main loop {r['total']} "
              f"instructions per thread per K step, {r['words']:g} weight words each: "
              f"{r['total'] / r['words']:.1f} per word ({ints:.1f} integer)")
        print("  per word: " + ", ".join(f"{op} {v:.2f}" for op, v in sorted(per.items(), key=lambda t: -t[1])[:14]))


if __name__ == "__main__":
    main()
