"""Compile the paged MLA kernels (dayzero/kernels/attention/_mla_*.py) for sm_90 on a machine without a GPU
and report what the H200 would run: shared memory, registers, spills, and the tensor-core instructions
(HGMMA = wgmma, HMMA = mma.sync) of each kernel's SASS. Costs no device time; uses the ptxas and
cuobjdump that Triton's wheel bundles (tools/sass_moe_mma.py).

    python tools/sass_attention_mla.py                          # DeepSeek-V3 shapes, H = 128 and 16, bf16 and FP8
    python tools/sass_attention_mla.py --heads 128 --block-n 64 --stages 3 --dump decode.sass

Integer arguments are specialised as a launch on the real pool would be: pointers and strides 16-divisible,
page strides too (Triton specialises every such value at launch).
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

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dayzero.kernels.attention import _mla_decode, _mla_prefill  # noqa: E402
from tools.sass_moe_mma import disassemble  # noqa: E402

FLOATS = {"qk_scale"}
CUDA = torch.device("cuda")  # the configs' device (no GPU needed to name one)
UNALIGNED = {"b0", "H", "SPLITS", "k0", "k1", "row_base", "lat_bs", "pe_bs", "stride_qr", "stride_ph"}


def compile_kernel(fn, pointers: dict[str, str], consts: dict, num_warps: int, num_stages: int):
    """fn (a triton.jit function) for sm_90 with pointer element types `pointers` (name -> "*bf16" ...),
    every other non-constexpr argument an i32 (fp32 for FLOATS), 16-divisible unless in UNALIGNED."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = pointers.get(name) or ("fp32" if name in FLOATS else "i32")
        if sig[name].startswith("*") or (sig[name] == "i32" and name not in UNALIGNED):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages))


def summary(name: str, compiled, dump: Path | None) -> None:
    usage, sass = disassemble(compiled, dump)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    opcode = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)
    ops = collections.Counter(m.group(1) for m in opcode.finditer(sass))
    mma = {op: ops[op] for op in ("HGMMA", "HMMA", "LDGSTS", "LDSM", "WARPGROUP") if ops[op]}
    print(f"{name}: shared {compiled.metadata.shared} B, registers {regs.group(1) if regs else '?'}, "
          f"stack (spills) {regs.group(2) if regs else '?'} B, {mma}")


def decode(heads: int, fp8: bool, overrides: dict, dump: Path | None) -> None:
    cfg = _mla_decode.decode_config(heads, fp8, CUDA)
    cfg = _mla_decode.DecodeConfig(**{**cfg.__dict__, **{k: v for k, v in overrides.items() if v}})
    kv = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "lat_ptr": kv, "lat_sc_ptr": "*fp32", "lat_tab_ptr": "*i32",
            "pe_ptr": kv, "pe_sc_ptr": "*fp32", "pe_tab_ptr": "*i32", "seq_lens_ptr": "*i32", "o_ptr": "*fp32",
            "lse_ptr": "*fp32"}
    consts = dict(C=512, DR=64, BLOCK_C=512, BLOCK_DR=64, GW_C=128, GW_R=64, FP8_LAT=fp8, FP8_PE=fp8,
                  BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DIRECT=False, DOT=tl.bfloat16, PRECISION=None,
                  INTERPRET=False, MAX_TILES=0)
    compiled = compile_kernel(_mla_decode._mla_decode_kernel, ptrs, consts, cfg.num_warps, cfg.num_stages)
    summary(f"decode H={heads} {'fp8' if fp8 else 'bf16'} {cfg}", compiled, dump)


def reduce() -> None:
    ptrs = {"o_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"}
    consts = dict(C=512, BLOCK_C=_mla_decode.REDUCE_COLUMNS, BLOCK_S=32)
    summary("reduce (32 splits)", compile_kernel(_mla_decode._mla_reduce_kernel, ptrs, consts, 4, 1), None)


def prefill(dump: Path | None) -> None:
    cfg = _mla_prefill.prefill_config(CUDA)
    ptrs = {n: "*bf16" for n in ("qn_ptr", "qp_ptr", "kn_ptr", "kpe_ptr", "v_ptr", "o_ptr")}
    ptrs.update({"lse_ptr": "*fp32", "query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "k_start_ptr": "*i32"})
    consts = dict(DN=128, DR=64, DV=128, BLOCK_DN=128, BLOCK_DR=64, BLOCK_DV=128, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, MERGE=False, DOT=tl.bfloat16, PRECISION=None, INTERPRET=False, MAX_TILES=0)
    compiled = compile_kernel(_mla_prefill._mla_prefill_kernel, ptrs, consts, cfg.num_warps, cfg.num_stages)
    summary(f"prefill {cfg}", compiled, dump)
    for fp8 in (False, True):
        kv = "*fp8e4nv" if fp8 else "*bf16"
        ptrs = {"lat_ptr": kv, "lat_sc_ptr": "*fp32", "lat_tab_ptr": "*i32", "pe_ptr": kv, "pe_sc_ptr": "*fp32",
                "pe_tab_ptr": "*i32", "seq_lens_ptr": "*i32", "k_start_ptr": "*i32", "out_lat_ptr": "*bf16",
                "out_pe_ptr": "*bf16"}
        consts = dict(C=512, DR=64, BLOCK_C=512, BLOCK_DR=64, GW_C=128, GW_R=64, FP8_LAT=fp8, FP8_PE=fp8,
                      BLOCK_T=_mla_prefill.GATHER_TOKENS)
        summary(f"gather {'fp8' if fp8 else 'bf16'}", compile_kernel(_mla_prefill._gather_kernel, ptrs, consts, 4, 1),
                None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--block-h", type=int, help="decode heads per program (default: decode_config's)")
    ap.add_argument("--block-n", type=int, help="decode keys per step (default: decode_config's)")
    ap.add_argument("--warps", type=int, help="decode warps (default: decode_config's)")
    ap.add_argument("--stages", type=int, help="decode pipeline stages (default: decode_config's)")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--dump", type=Path, help="write the last decode kernel's SASS here")
    args = ap.parse_args()
    for h in args.heads:
        for fp8 in (False, True):
            decode(h, fp8, dict(block_h=args.block_h, block_n=args.block_n, num_warps=args.warps,
                                num_stages=args.stages), args.dump)
    if not args.decode_only:
        reduce()
        prefill(None)


if __name__ == "__main__":
    main()
