"""Compile the prefill GEMM (dayzero/kernels/moe/_mma.py) for sm_90 on a machine without a GPU and report
what the H200 would run: shared memory, registers, spills, and the SASS opcodes of the main loop.
Costs no device time; uses the ptxas and cuobjdump that Triton's wheel bundles.

    python tools/sass_moe_mma.py --k 2880 --mxfp4 --gated --tile 128x64x64x4x4
    python tools/sass_moe_mma.py --k 4096 --tile 128x256x64x8x3 --dump out.sass   # bf16 down GEMM

The kernel's integer arguments are specialised as `_mma.mma_gemm` launches them on contiguous weights:
pointers and the activation / output row strides 16-divisible; the weight row stride too for bf16
(`--stride-aligned` forces it for MXFP4, which Triton 3.6 fails to compile: docs/kernels.md).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dayzero.kernels.moe import _mma as moe_mma  # noqa: E402

ARGS = [("a_ptr", "*bf16"), ("w_ptr", None), ("s_ptr", "*u8"), ("bias_ptr", "*bf16"), ("out_ptr", "*bf16"),
        ("row_pair_ptr", "*i32"), ("block_expert_ptr", "*i32"), ("router_weight_ptr", "*fp32"),
        ("N", "i32"), ("S", "i32"), ("E", "i32"), ("num_blocks", "i32"), ("up_offset", "i32"), ("alpha", "fp32"),
        ("limit", "fp32"), ("stride_am", "i32"), ("stride_we", "i64"), ("stride_wn", "i32"), ("stride_se", "i32"),
        ("stride_sn", "i32"), ("stride_be", "i32"), ("stride_om", "i32")]
ALIGNED = {"a_ptr", "w_ptr", "s_ptr", "bias_ptr", "out_ptr", "row_pair_ptr", "block_expert_ptr", "router_weight_ptr",
           "stride_am", "stride_we", "stride_se", "stride_sn", "stride_be", "stride_om"}


def tools_bin(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def disassemble(compiled, dump: Path | None = None) -> tuple[str, str]:
    """(resource usage, SASS) of a compiled kernel's cubin, by the bundled cuobjdump; dump: also write
    the SASS there."""
    cubin = Path(f"/tmp/sass_{os.getpid()}.cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        usage = subprocess.run([tools_bin("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([tools_bin("cuobjdump"), "--dump-sass", str(cubin)], capture_output=True,
                              text=True).stdout
    finally:
        cubin.unlink()
    if dump:
        dump.write_text(sass)
    return usage, sass


def compile_variant(k: int, mxfp4: bool, gated: bool, tile: tuple[int, ...], stride_aligned: bool):
    bm, bn, bk, warps, stages = tile
    wfmt = moe_mma.WFMT_MXFP4 if mxfp4 else moe_mma.WFMT_BF16
    sig = {name: ty or ("*i32" if mxfp4 else "*bf16") for name, ty in ARGS}
    consts = dict(K=k, WFMT=wfmt, GATHER=gated, TOP_K=4, ACTIVATION=2 if gated else 0, HAS_LIMIT=gated, HAS_BIAS=False,
                  ROUTER_WEIGHT=not gated, EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                  INTERPRET=False)
    sig.update({name: "constexpr" for name in consts})
    aligned = ALIGNED | ({"stride_wn"} if stride_aligned or not mxfp4 else set())
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, _) in enumerate(ARGS) if name in aligned}
    kernel = moe_mma._mma_kernel_words if mxfp4 else moe_mma._mma_kernel
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def loop_opcodes(sass: str) -> tuple[collections.Counter, int]:
    """Opcode counts of the longest loop (the body between a backward branch and its target)."""
    lines = sass.splitlines()
    addr = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", line)
        if m:
            addr[int(m.group(1), 16)] = i
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?.*?0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16) and int(m.group(2), 16) in addr:
            start = addr[int(m.group(2), 16)]
            if i - start > best[1] - best[0]:
                best = (start, i)
    ops = collections.Counter()
    for line in lines[best[0]:best[1] + 1]:
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops, sum(ops.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, required=True, help="the GEMM's K (hidden for gate/up, intermediate for down)")
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4 words with the hand upcast (else bf16 weights)")
    ap.add_argument("--gated", action="store_true", help="the gate/up GEMM (two accumulators, activation)")
    ap.add_argument("--tile", required=True, help="BMxBNxBKxWARPSxSTAGES, e.g. 128x64x64x4x4")
    ap.add_argument("--stride-aligned", action="store_true", help="specialise the MXFP4 word stride's alignment")
    ap.add_argument("--dump", type=Path, help="write the whole SASS here")
    args = ap.parse_args()
    tile = tuple(int(v) for v in args.tile.split("x"))
    compiled = compile_variant(args.k, args.mxfp4, args.gated, tile, args.stride_aligned)
    report(compiled, loop_opcodes, args.dump, 16)


def report(compiled, loop_ops, dump: Path | None, top: int) -> None:
    """Print shared memory, registers, spills and the opcodes of the loop `loop_ops` picks from the SASS
    of a compiled kernel (its cubin disassembled with the bundled cuobjdump); dump: also write the SASS."""
    usage, sass = disassemble(compiled, dump)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    ops, total = loop_ops(sass)
    print(f"shared {compiled.metadata.shared} B, registers {regs.group(1) if regs else '?'}, "
          f"stack (spills) {regs.group(2) if regs else '?'} B; main loop {total} instructions per thread per K step")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(top)))

if __name__ == "__main__":
    main()
