"""Tile sweep of the prefill grouped GEMM (dayzero/kernels/moe_mma.py) on one GPU: each GEMM alone, then
whole layers, in CUDA graphs with the weights rotating over copies far larger than L2, against the
transposed tensor-core kernel it replaces (moe_gemm) in the same run, and the measured bf16 matmul rate.

    python bench/moe_prefill.py --precompile 16    # fill Triton's cache from 16 processes first
    python bench/moe_prefill.py --json out.json    # gpt-oss-120b and DeepSeek-V4 at 512 to 8192 tokens

Variants: "hand" (MXFP4 words upcast by moe_gemm's bit manipulation), "scaled" (MXFP4 bytes through
tl.dot_scaled; --variants scaled, not run by default), "bf16" (path C's dequantized weights). Per model, token count, variant and GEMM
(gate/up with bias + activation; down with bias x router weight) every tile of the grid is timed;
TFLOP/s count the rows actually routed (2 * pairs * N * K), not the padding. Then the whole layer
(dispatch, both GEMMs, combine) with the default tiles, with each variant's best tiles, and on the
old kernel, with its error against the exact float32 layer. Method as bench/moe.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import MODELS, copy_bandwidth, matmul_rate, mxfp4_copies, random_experts, rel_err, to_bf16  # noqa: E402
from bench.moe import graph_replay_us as graph_us  # noqa: E402
from dayzero.ops.moe import ExpertWeights, _experts_reference  # noqa: E402

TOKENS = (512, 1024, 2048, 8192)
VARIANTS = ("hand", "scaled", "bf16")
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the gated GEMM's BLOCK_N is per accumulator (two held).
GEMM1_TILES = [(128, 64, 64, 4, 4), (128, 64, 64, 4, 3), (128, 32, 64, 4, 4), (128, 32, 64, 4, 3), (128, 32, 128, 4, 3),
               (128, 128, 64, 8, 4), (256, 64, 64, 8, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4)]
GEMM2_TILES = [(128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
               (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (64, 64, 64, 4, 4)]


def tiles_arg(text: str) -> list[tuple[int, ...]]:
    """'128x128x64x8x3,64x128x64x4x4' -> [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4)]"""
    return [tuple(int(v) for v in t.split("x")) for t in text.split(",")]


def weights_of(e: ExpertWeights, variant: str):
    """(w13, s13, w2, s2) as moe_gemm / moe_mma take them."""
    if variant == "bf16":
        return e.w13, None, e.w2, None
    E, n13, H = e.w13.shape[0], e.w13.shape[1], e.w13.shape[2] * 32
    return (e.w13.view(torch.int32).view(E, n13, H // 8), e.w13_scale,
            e.w2.view(torch.int32).view(E, H, n13 // 16), e.w2_scale)


def config(t, variant):
    from dayzero.kernels.moe_mma import MmaConfig

    bm, bn, bk, nw, ns = t[:5]
    return MmaConfig(bm, bn, bk, nw, ns, group_m=t[5] if len(t) > 5 else 8, scaled=variant == "scaled")


def _act(act) -> int:
    from dayzero.kernels.moe_gemm import kernel_activation

    return kernel_activation(act)[0]


def precompile(workers: int, models, variants) -> None:
    """Compile every kernel variant the sweep launches, spread over processes (Triton's disk cache)."""
    import multiprocessing as mp

    jobs = [(m, v, 1, t) for m in models for v in variants for t in GEMM1_TILES]
    jobs += [(m, v, 2, t) for m in models for v in variants for t in GEMM2_TILES]
    with mp.get_context("spawn").Pool(workers) as pool:
        failed = [r for r in pool.imap_unordered(_compile_one, jobs) if r]
    print(f"precompiled {len(jobs)} kernel variants with {workers} processes; {len(failed)} failed", flush=True)
    for f in failed:
        print("  compile failed:", f, flush=True)


def _compile_one(job):
    from dayzero.kernels.moe_dispatch import dispatch
    from dayzero.kernels.moe_mma import mma_gemm

    model, variant, which, t = job
    E, k, H, I, act, bias = MODELS[model]
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        e = random_experts(2, H, I, bias, gen)
        if variant == "bf16":
            e = to_bf16(e)
        w13, s13, w2, s2 = weights_of(e, variant)
        ids = torch.zeros(2, k, dtype=torch.int64, device="cuda")
        c = config(t, variant)
        d = dispatch(ids, 2, c.block_m)
        if which == 1:
            x = torch.randn(2, H, device="cuda").bfloat16()
            mma_gemm(x, w13, s13, e.b13, d, out_features=I, gather=True, activation=_act(act), alpha=act.alpha or 1.0,
                     limit=act.limit, config=c)
        else:
            h = torch.randn(d.max_rows, I, device="cuda").bfloat16()
            mma_gemm(h, w2, s2, e.b2, d, out_features=H, gather=False, router_weights=torch.ones(ids.numel(), device="cuda"),
                     config=c)
        torch.cuda.synchronize()
    except Exception as exc:  # reported, the sweep skips it
        return f"{job}: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def sweep_model(name: str, tokens, variants, reps: int, copies: int, flops: float, rows: list) -> None:
    from dayzero.kernels.moe_dispatch import dispatch
    from dayzero.kernels.moe_gemm import choose_config
    from dayzero.kernels.moe_mma import choose_mma_configs, mma_gemm
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4_fused
    from dayzero.kernels.moe_bf16 import moe_experts_bf16

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = random_experts(E, H, I, bias, gen)
    sets = {"mx": mxfp4_copies(base, copies)}
    if "bf16" in variants:
        bf = to_bf16(base)
        sets["bf16"] = [bf] + [ExpertWeights("bf16", bf.w13.clone(), bf.w2.clone(), b13=bf.b13, b2=bf.b2)
                               for _ in range(copies - 1)]
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
        rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
        pairs = T * k
        f1, f2 = 2 * pairs * 2 * I * H, 2 * pairs * H * I
        ref = _experts_reference(x.float(), ids, rw, base, act)
        for variant in variants:
            wsets = [weights_of(e, variant) for e in sets["bf16" if variant == "bf16" else "mx"]]
            best = {}
            for bm in sorted({t[0] for t in GEMM1_TILES} & {t[0] for t in GEMM2_TILES}):
                d = dispatch(ids, E, bm)
                h = None
                for which, tiles, fl in ((1, GEMM1_TILES, f1), (2, GEMM2_TILES, f2)):
                    for t in (t for t in tiles if t[0] == bm):
                        c = config(t, variant)
                        if which == 1:
                            fn = lambda s, c=c: mma_gemm(x, wsets[s][0], wsets[s][1], base.b13, d, out_features=I,  # noqa: E731
                                                         gather=True, activation=_act(act), alpha=act.alpha or 1.0,
                                                         limit=act.limit, config=c)
                            if h is None:
                                try:
                                    h = fn(0)
                                except Exception as exc:
                                    print(f"{name:>13} T={T:>5} {variant:>6} gemm1 {t}: FAILED {type(exc).__name__}: "
                                          f"{str(exc)[:200]}", flush=True)
                                    continue
                        else:
                            fn = lambda s, c=c: mma_gemm(h, wsets[s][2], wsets[s][3], base.b2, d, out_features=H,  # noqa: E731
                                                         gather=False, router_weights=rw.view(-1), config=c)
                        try:
                            us = graph_us(fn, copies, reps)
                        except Exception as exc:
                            print(f"{name:>13} T={T:>5} {variant:>6} gemm{which} {t}: FAILED {type(exc).__name__}: "
                                  f"{str(exc)[:200]}", flush=True)
                            continue
                        tf = fl / (us * 1e-6) / 1e12
                        rows.append({"model": name, "tokens": T, "variant": variant, "gemm": which, "tile": t, "us": us,
                                     "tflops": tf, "bf16_pct": 100 * tf * 1e12 / flops})
                        print(f"{name:>13} T={T:>5} {variant:>6} gemm{which} {t}: {us:8.1f} us {tf:6.1f} TF "
                              f"({100 * tf * 1e12 / flops:4.1f}% bf16)", flush=True)
                        if (bm, which) not in best or us < best[(bm, which)][0]:
                            best[(bm, which)] = (us, t)
            bms = [bm for bm in {b for b, _ in best} if (bm, 1) in best and (bm, 2) in best]
            if not bms:
                continue
            bm = min(bms, key=lambda b: best[(b, 1)][0] + best[(b, 2)][0])
            cfg = (config(best[(bm, 1)][1], variant), config(best[(bm, 2)][1], variant))
            default = choose_mma_configs(pairs, E, variant != "bf16", I, H)
            if default is not None and variant != "bf16":
                default = tuple(replace(c, scaled=variant == "scaled") for c in default)
            layers = {"best": cfg, "default": default}
            if variant != "scaled":
                layers["old kernel"] = (choose_config(pairs, E, I, variant != "bf16", True),
                                        choose_config(pairs, E, H, variant != "bf16", False))
            for label, cf in layers.items():
                if cf is None:
                    continue
                if variant == "bf16":
                    layer = lambda s, cf=cf: moe_experts_bf16(x, ids, rw, sets["bf16"][s], act, configs=cf)  # noqa: E731
                else:
                    layer = lambda s, cf=cf: moe_experts_mxfp4_fused(x, ids, rw, sets["mx"][s], act, configs=cf)  # noqa: E731
                try:
                    err = rel_err(layer(0), ref)
                    us = graph_us(layer, copies, reps)
                except Exception as exc:
                    print(f"{name:>13} T={T:>5} {variant:>6} layer {label}: FAILED {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)
                    continue
                tf = (f1 + f2) / (us * 1e-6) / 1e12
                rows.append({"model": name, "tokens": T, "variant": variant, "gemm": "layer", "label": label,
                             "config": repr(cf), "us": us, "tflops": tf, "bf16_pct": 100 * tf * 1e12 / flops,
                             "err": err})
                print(f"{name:>13} T={T:>5} {variant:>6} layer {label:>10}: {us:8.1f} us {tf:6.1f} TF "
                      f"({100 * tf * 1e12 / flops:4.1f}% bf16) err {err:.1e}  {cf}", flush=True)


def main() -> None:
    global GEMM1_TILES, GEMM2_TILES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--variants", nargs="+", default=["hand", "bf16"], choices=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--precompile", type=int, default=0, metavar="PROCESSES")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--gemm1-tiles", type=tiles_arg, help="BMxBNxBKxWARPSxSTAGES[xGROUP_M],... (default: the grid above)")
    ap.add_argument("--gemm2-tiles", type=tiles_arg)
    args = ap.parse_args()
    GEMM1_TILES = args.gemm1_tiles or GEMM1_TILES
    GEMM2_TILES = args.gemm2_tiles or GEMM2_TILES
    if not torch.cuda.is_available():
        sys.exit("bench/moe_prefill.py needs a CUDA device")
    if args.precompile:
        precompile(args.precompile, args.models, args.variants)
    bw, flops = copy_bandwidth(), matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {flops / 1e12:.0f} TFLOP/s",
          flush=True)
    rows: list[dict] = []
    for name in args.models:
        sweep_model(name, args.tokens, args.variants, args.reps, args.copies, flops, rows)
        torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps({"copy_bytes_per_s": bw, "bf16_flops": flops, "rows": rows}, indent=1))
    print("\n| model | T | variant | layer | µs | TFLOP/s (% bf16) | rel err | tiles |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["gemm"] == "layer":
            print(f"| {r['model']} | {r['tokens']} | {r['variant']} | {r['label']} | {r['us']:.1f} | {r['tflops']:.1f} "
                  f"({r['bf16_pct']:.0f}%) | {r['err']:.1e} | {r['config']} |")


if __name__ == "__main__":
    main()
