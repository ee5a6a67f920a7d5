"""Prefill MoE layer with MXFP4 experts on the H200: the Gluon wgmma kernel (dayzero/kernels/moe_wgmma.py)
against the Triton prefill kernel it replaces (moe_mma, path A before) and the bf16 path C, in the same
run, against the measured bf16 matmul rate.

    python bench/moe_wgmma.py                                   # both models, 512 2048 8192 tokens
    python bench/moe_wgmma.py --models gpt-oss-120b --tokens 8192 --tiles 128x4 256x3

Per model and token count: the whole layer (dispatch, gather + permute, both GEMMs, combine) in one CUDA
graph replay with the weights rotating over copies larger than L2 (method of bench/moe.py), for each
wgmma tile (rows per program x stages; "s" = A_SMEM, the upcast tile through shared memory with one
wgmma in flight; "lo" = one bf16 multiply per code pair, valid only where no
scale byte exceeds 128, which holds for these weights), the two GEMMs of the default tile alone, the layer
as the registry runs it (default tile; the scale check picks "lo" here), moe_mma with its default tiles,
and path C (bf16 weights, moe_mma). All of them and an 8192^3 bf16 matmul are timed rep by rep in turn
(bench/moe_decode.interleaved_us), and the % of the bf16 rate is against that matmul, so that every
number comes from the same thermal state. TFLOP/s count the routed rows only
(2 * tokens * top_k * 3 * H * I), not the padding; error: relative to the exact float32 layer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import MODELS, copy_bandwidth, matmul_rate, mxfp4_copies, random_experts, rel_err, to_bf16  # noqa: E402
from bench.moe_decode import interleaved_us  # noqa: E402
from dayzero.kernels import moe_wgmma  # noqa: E402
from dayzero.ops.moe import ExpertWeights, _experts_reference  # noqa: E402

TOKENS = (512, 2048, 8192)
MATMUL = "bf16 matmul 8192^3"


def tile_arg(text: str) -> tuple[moe_wgmma.WgmmaConfig, bool, str]:
    """'128x4' -> (WgmmaConfig, high scales, label); suffixes in this order: 'lo' one multiply per pair;
    's' A_SMEM or 'p' pipeline (two register sets, one wgmma in flight); 't2' up to 2 tail blocks of 64
    rows per expert (split_blocks), 't1-32' of 32 rows; 'r128' a ptxas register cap."""
    m = re.fullmatch(r"(\d+)x(\d+)(lo)?([sp])?(?:t(\d)(?:-(\d+))?)?(?:r(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"tile {text!r}: expected e.g. 128x4, 128x4lo, 256x4lopt2, 256x3pt1-32, "
                                         "128x4pr128")
    bt, st, lo, mode, tails, tail_rows, regs = m.groups()
    cfg = moe_wgmma.WgmmaConfig(int(bt), int(st), a_smem=mode == "s", pipeline=mode == "p",
                                max_registers=int(regs) if regs else None, tail_blocks=int(tails or 0),
                                tail_rows=int(tail_rows or moe_wgmma.TAIL_BLOCK))
    return cfg, lo is None, text


def cfg_label(cfg) -> str:
    """The tile_arg spelling of a config, without 'lo'."""
    return (f"{cfg.block_t}x{cfg.num_stages}" + ("s" if cfg.a_smem else "p" if cfg.pipeline else "")
            + (f"t{cfg.tail_blocks}" if cfg.tail_blocks else "")
            + (f"-{cfg.tail_rows}" if cfg.tail_blocks and cfg.tail_rows != moe_wgmma.TAIL_BLOCK else ""))


def bench_model(name, tokens, tiles, reps, copies, flops, rows, with_c: bool) -> None:
    from dayzero.kernels.moe_bf16 import moe_experts_bf16
    from dayzero.kernels.moe_mma import choose_mma_configs
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4_fused

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = random_experts(E, H, I, bias, gen)
    mx = mxfp4_copies(base, copies)
    bf = None
    if with_c:
        b0 = to_bf16(base)
        bf = [b0] + [ExpertWeights("bf16", b0.w13.clone(), b0.w2.clone(), b13=b0.b13, b2=b0.b2) for _ in range(copies - 1)]
    words = [(e.w13.view(torch.int32).view(E, 2 * I, H // 8), e.w13_scale, e.w2.view(torch.int32).view(E, H, I // 8),
              e.w2_scale) for e in mx]
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
        rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
        fl = 2 * T * k * 3 * H * I
        ref = _experts_reference(x.float(), ids, rw, base, act)
        fns, errs = {}, {}

        def record(label, fn, gemm_only=False):  # checked now, timed below with the others
            try:
                errs[label] = float("nan") if gemm_only else rel_err(fn(0), ref)
                fns[label] = fn
            except Exception as exc:  # a tile that does not fit is reported, the run goes on
                print(f"{name:>13} T={T:>5} {label:>22}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)

        for cfg, high, text in tiles:
            record(f"wgmma {text}",
                   lambda s, cfg=cfg, high=high: moe_wgmma.moe_layer_wgmma(
                       x, ids, rw, *words[s][:2], *words[s][2:], base.b13, base.b2, act, inter=I, config=cfg,
                       high_scales=high))
        cfg = moe_wgmma.choose_wgmma_config(T * k, E)
        if cfg is not None:  # (None: the decode kernels or moe_gemm run this size)
            d, runs = moe_wgmma.plan(ids, E, cfg)
            xp = moe_wgmma.gather_permute(x, d, gather=True)
            record(f"gemms only {cfg_label(cfg)}lo", lambda s: moe_wgmma.expert_gemms(
                xp, d, runs, *words[s], base.b13, base.b2, act, rw, inter=I, high_scales=False), gemm_only=True)
        record("layer (default choice)", lambda s: moe_experts_mxfp4_fused(x, ids, rw, mx[s], act))
        mma = choose_mma_configs(T * k, E, True, I, H)
        if mma is not None:
            record("moe_mma (A before)", lambda s: moe_experts_mxfp4_fused(x, ids, rw, mx[s], act, configs=mma))
        if bf is not None:
            record("path C bf16", lambda s: moe_experts_bf16(x, ids, rw, bf[s], act))
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        fns[MATMUL] = lambda s: a @ a  # the bf16 rate in the same thermal state as the layers
        us = interleaved_us(fns, copies, reps)
        rate = 2 * 8192**3 / (us.pop(MATMUL) * 1e-6)
        print(f"{name:>13} T={T:>5} {MATMUL}, interleaved with the layers: {rate / 1e12:.0f} TFLOP/s "
              f"(at the start of the run: {flops / 1e12:.0f})", flush=True)
        for label, t in us.items():
            tf = fl / (t * 1e-6) / 1e12
            rows.append({"model": name, "tokens": T, "label": label, "us": t, "tflops": tf,
                         "bf16_pct": 100 * tf * 1e12 / rate, "bf16_rate": rate, "err": errs[label]})
            print(f"{name:>13} T={T:>5} {label:>22}: {t:9.1f} us {tf:6.1f} TF/s ({100 * tf * 1e12 / rate:4.1f}% bf16)"
                  + ("" if errs[label] != errs[label] else f" err {errs[label]:.1e}"), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--tiles", nargs="+", type=tile_arg, default=[tile_arg(t) for t in ("64x4lo", "128x4", "128x4lo",
                                                                                         "128x3lo", "256x3lo")])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--no-c", action="store_true", help="skip path C (saves the bf16 copies' memory and time)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bw, flops = copy_bandwidth(), matmul_rate()
    print(f"{datetime.date.today()} {torch.cuda.get_device_name()}, torch {torch.__version__}; copy {bw / 1e12:.2f} "
          f"TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for name in args.models:
        bench_model(name, args.tokens, args.tiles, args.reps, args.copies, flops, rows, not args.no_c)
        torch.cuda.empty_cache()
    base = {(r["model"], r["tokens"]): r["us"] for r in rows if r["label"] == "moe_mma (A before)"}
    print("\n| model | tokens | variant | µs | TFLOP/s | % bf16 rate | moe_mma µs / this | rel err |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = base.get((r["model"], r["tokens"]))
        print(f"| {r['model']} | {r['tokens']} | {r['label']} | {r['us']:.1f} | {r['tflops']:.1f} | {r['bf16_pct']:.1f}% | "
              f"{ratio / r['us']:.2f} | {r['err']:.1e} |" if ratio else
              f"| {r['model']} | {r['tokens']} | {r['label']} | {r['us']:.1f} | {r['tflops']:.1f} | {r['bf16_pct']:.1f}% | - | "
              f"{r['err']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps({"copy_bw": bw, "bf16_flops": flops, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
