"""Compile the paged GQA attention kernels (dayzero/kernels/attention) for sm_90 on a machine without a
GPU and report what the H200 would run: shared memory, registers, spills, and the opcodes of the
longest loop (HGMMA = wgmma, HMMA = mma.sync). Costs no device time; uses the ptxas and cuobjdump that
Triton's wheel bundles (see sass_moe_mma.py).

    python tools/sass_attention_gqa.py prefill                       # gpt-oss: 64/8 heads, dim 64, bf16, pages of 16
    python tools/sass_attention_gqa.py decode --fp8 --window 128
    python tools/sass_attention_gqa.py prefill --tile 128x128x8x3    # BLOCK_MxBLOCK_NxWARPSxSTAGES

Arguments are specialised as a launch on gpt-oss's cache sees them: pointers, the q/out row strides and
the pool's page/slot/head strides 16-divisible, the block-table row stride not (any table width)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dayzero.kernels.attention import _gqa_decode, _gqa_prefill  # noqa: E402
from dayzero.kernels.attention.gqa_choose import choose  # noqa: E402
from tools.sass_moe_mma import loop_opcodes, report  # noqa: E402

UNALIGNED = {"stride_kt", "stride_vt", "qk_scale", "window", "first_seq", "num_seqs", "q_base", "splits"}


def compile_kernel(kernel, pointer_types: dict, consts: dict, num_warps: int, num_stages: int):
    """kernel compiled for sm_90: pointer params typed by pointer_types (name -> '*bf16' ...), other
    non-constexpr params i32 (qk_scale fp32), 16-divisible unless named in UNALIGNED."""
    sig, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            continue
        sig[p.name] = pointer_types.get(p.name) or ("fp32" if p.name == "qk_scale" else "i32")
        if p.name not in UNALIGNED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=("decode", "reduce", "prefill"))
    ap.add_argument("--heads", default="64x8", help="query x kv heads")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=16, help="tokens per page")
    ap.add_argument("--fp8", action="store_true", help="float8_e4m3fn keys and values with float32 scales")
    ap.add_argument("--window", action="store_true", help="a sliding window")
    ap.add_argument("--no-sinks", action="store_true")
    ap.add_argument("--separate-tables", action="store_true", help="k and v paged by different tables")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--tile", help="BLOCK_MxBLOCK_NxWARPSxSTAGES (prefill) / BLOCK_NxWARPSxSTAGES (decode); "
                                   "default: what choose picks at --query-len keys")
    ap.add_argument("--query-len", type=int, default=8192, help="the prompt length choose picks the tiles for")
    ap.add_argument("--dump", type=Path, help="write the whole SASS here")
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("x"))
    g, d, dt = hq // hkv, args.dim, "*" + args.dtype
    kv = "*fp8e4nv" if args.fp8 else dt
    sc = "*fp32" if args.fp8 else dt
    ptrs = dict(q_ptr=dt, k_ptr=kv, ks_ptr=sc, v_ptr=kv, vs_ptr=sc, k_table_ptr="*i32", v_table_ptr="*i32",
                qstart_ptr="*i32", seqlen_ptr="*i32", sinks_ptr="*fp32", out_ptr=dt, part_acc_ptr="*fp32",
                part_ml_ptr="*fp32")
    block = max(16, triton.next_power_of_2(d))
    common = dict(D=d, DV=d, PAGE_K=args.page, PAGE_V=args.page, BLOCK_D=block, BLOCK_DV=block,
                  HAS_WINDOW=args.window, HAS_SINKS=not args.no_sinks, K_FP8=args.fp8, V_FP8=args.fp8,
                  SAME_TABLE=not args.separate_tables,
                  DOT_F32=args.dtype == "fp32", INTERPRET=False)
    tile = [int(x) for x in args.tile.split("x")] if args.tile else None
    if args.kernel == "prefill":
        cfg = choose((args.query_len,), (args.query_len,), hq, hkv, d, 128 if args.window else None, float32=args.dtype == "fp32").prefill
        bm, bn, warps, stages = tile or (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
        consts = dict(common, HKV=hkv, G=g, BLOCK_M=bm, BQ=bm // g, BLOCK_N=bn)
        compiled = compile_kernel(_gqa_prefill._prefill_kernel, ptrs, consts, warps, stages)
    elif args.kernel == "decode":
        cfg = choose((1,) * 64, (args.query_len,) * 64, hq, hkv, d, 128 if args.window else None).decode
        bn, warps, stages = tile or (cfg.block_n, cfg.num_warps, cfg.num_stages)
        consts = dict(common, HQ=hq, G=g, BLOCK_H=max(16, triton.next_power_of_2(g)), BLOCK_N=bn, SPLIT=True)
        compiled = compile_kernel(_gqa_decode._decode_kernel, ptrs, consts, warps, stages)
    else:
        consts = dict(HQ=hq, DV=d, BLOCK_S=64, BLOCK_DV=triton.next_power_of_2(d), HAS_SINKS=not args.no_sinks)
        compiled = compile_kernel(_gqa_decode._reduce_kernel, ptrs, consts, 4, 1)
    print(f"{args.kernel} {consts}")
    report(compiled, loop_opcodes, args.dump, 20)


if __name__ == "__main__":
    main()
