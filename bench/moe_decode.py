"""Tile sweep of path A's decode kernels (dayzero/kernels/moe_decode.py) on one GPU: each GEMM alone,
then whole layers, in CUDA graphs with the weights rotating over copies far larger than L2.

    python bench/moe_decode.py --precompile 12     # fill Triton's cache from 12 processes first
    python bench/moe_decode.py --json out.json     # time: gpt-oss-120b and DeepSeek-V4 at 1, 8, 32 tokens
    python bench/moe_decode.py --gluon-ab --tokens 1 --per-graph 1 8   # the Triton layer vs the Gluon GEMMs (sm_90)
    python bench/moe_decode.py --gluon-tiles-ab --tokens 1 --per-graph 8   # the Gluon default vs other Gluon tiles
    python bench/moe_decode.py --narrowk-ab --models gpt-oss-120b --tokens 8 32 --per-graph 8   # 64-code K tiles

Per model and token count: the gate/up GEMM (bias + activation + quantized h) and the down GEMM
(bias x router weight) are timed alone for every (BLOCK_M, BLOCK_N, BLOCK_K, warps) in the grid, as %
of the measured device-to-device copy bandwidth on the MXFP4 bytes of the distinct active experts;
then the whole layer (dispatch, quantize, both GEMMs, combine) with the default tiles
(choose_decode_config), with the best tiles of each GEMM, and on the tensor-core kernel (moe_gemm,
the path A before the decode kernels). Method as bench/moe.py (median of --reps graph replays).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import MODELS as LAYERS  # noqa: E402
from bench.moe import (capture_graphs, copy_bandwidth, graph_replay_us, median_ms, mxfp4_copies,  # noqa: E402
                       random_experts, rel_err)
from dayzero.kernels.pdl import PDL_ENV  # noqa: E402
from dayzero.ops.moe import ExpertWeights, _experts_reference  # noqa: E402

# The two models' layers, and shapes between them for diagnosis (--models): gpt-oss-120b's layer with
# K = N = 3072 (a power-of-two multiple of the K tiles, no overlapping last tile), and without its biases
# and clamped activation
MODELS = {**LAYERS,
          "gpt-oss-k3072": (128, 4, 3072, 3072) + LAYERS["gpt-oss-120b"][4:],
          "gpt-oss-plain": (128, 4, 2880, 2880) + LAYERS["deepseek-v4"][4:]}
TOKENS = (1, 8, 32)
EXTRA_TOKENS = (64, 128, 256)  # layer only: decode kernels (4-row blocks past 3.5 rows) vs the tensor-core kernel
BLOCK_MS = {1: (1,), 8: (1, 2, 4), 32: (1, 2, 4)}
# (BLOCK_N, BLOCK_K, warps); BLOCK_N * BLOCK_K / 32 >= 32 * warps keeps at least one 32-value block per
# thread. Wide BLOCK_K with many warps splits K inside a program (fewer serial steps per program).
GEMM1_TILES = [(32, 128, 4), (32, 256, 4), (32, 256, 8), (32, 512, 4), (32, 512, 8), (32, 1024, 8), (32, 1024, 16),
               (64, 128, 4), (64, 256, 4), (64, 256, 8), (64, 512, 16)]
GEMM2_TILES = [(16, 256, 4), (16, 512, 4), (16, 512, 8), (16, 1024, 8), (16, 1024, 16), (32, 128, 4), (32, 256, 4),
               (32, 512, 4), (32, 1024, 16), (64, 128, 4), (64, 256, 4), (64, 256, 8), (64, 512, 8)]


def tiles_arg(text: str) -> list[tuple[int, int, int, int]]:
    """'32x256x4,64x256x8x3' -> [(32, 256, 4, 0), (64, 256, 8, 3)]: BLOCK_N x BLOCK_K x warps [x stages,
    0 = the hand prefetch]"""
    return [(tuple(int(v) for v in t.split("x")) + (0,))[:4] for t in text.split(",")]


def words(e: ExpertWeights):
    E, n13, H = e.w13.shape[0], e.w13.shape[1], e.w13.shape[2] * 32
    return (e.w13.view(torch.int32).view(E, n13, H // 8), e.w13_scale,
            e.w2.view(torch.int32).view(E, H, n13 // 16), e.w2_scale)


def interleaved_us(fns: dict, copies: int, reps: int, per_graph: int = 1) -> dict:
    """graph_replay_us of every fn in fns (label -> fn(copy)), per call of per_graph calls captured in one graph
    (bench.moe.capture_graphs), timed rep by rep in turn, so that all of them see
    the same thermal and power state (a compute-bound layer's time drifts by up to 10% as the card heats
    over a run): {label: median µs}. The first pass is warm-up. The order of the variants is shuffled
    in every pass (fixed seed): in a fixed order a variant timed after a hot one (a long compute-bound
    layer, the matmul) ran up to 14% slower than the same kernels timed after cooler ones."""
    graphs = {label: capture_graphs(fn, copies, per_graph) for label, fn in fns.items()}
    times = {label: [] for label in fns}
    order = list(graphs)
    shuffle = random.Random(0).shuffle
    for rep in range(reps + 1):
        shuffle(order)
        for label in order:
            for s, g in enumerate(graphs[label]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                if rep:
                    times[label].append(1e3 * start.elapsed_time(end) / per_graph)
    del graphs
    return {label: statistics.median(t) for label, t in times.items()}


def precompile(workers: int) -> None:
    """Compile every kernel variant the sweep launches, spread over processes (Triton's disk cache)."""
    import multiprocessing as mp

    bms = sorted({bm for v in BLOCK_MS.values() for bm in v})
    jobs = [(m, bm, 1, t) for m in LAYERS for bm in bms for t in GEMM1_TILES]
    jobs += [(m, bm, 2, t) for m in LAYERS for bm in bms for t in GEMM2_TILES]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        for _ in pool.imap_unordered(_compile_one, jobs):
            pass
    print(f"precompiled {len(jobs)} kernel variants with {workers} processes", flush=True)


def _compile_one(job) -> None:
    from dayzero.kernels.moe_decode import decode_gemm, quantize_rows
    from dayzero.kernels.moe_dispatch import dispatch

    model, bm, which, tile = job
    bn, bk, nw, st = (tuple(tile) + (0,))[:4]
    E, k, H, I, act, bias = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    e = random_experts(2, H, I, bias, gen)
    w13, s13, w2, s2 = words(e)
    ids = torch.zeros(2, k, dtype=torch.int64, device="cuda")
    d = dispatch(ids, 2, bm)
    if which == 1:
        x = torch.randn(2, H, device="cuda").bfloat16()
        xq, xs = quantize_rows(x)
        decode_gemm(xq, xs, w13, s13, e.b13, d, out_features=I, gather=True, activation=_act(act),
                    alpha=act.alpha or 1.0, limit=act.limit, block_n=bn, block_k=bk, num_warps=nw, stages=st)
    else:
        hq = torch.zeros(d.max_rows, 4, I // 8, dtype=torch.int32, device="cuda")
        hs = torch.zeros(d.max_rows, 2, I // 32, device="cuda")
        decode_gemm(hq, hs, w2, s2, e.b2, d, out_features=H, gather=False,
                    router_weights=torch.ones(ids.numel(), device="cuda"), block_n=bn, block_k=bk, num_warps=nw,
                    stages=st)
    torch.cuda.synchronize()


def _act(act) -> int:
    from dayzero.kernels.moe_gemm import kernel_activation

    return kernel_activation(act)[0]


def sweep_model(name: str, reps: int, copies: int, bw: float, rows: list, extra_only: bool = False,
                pdl_ab: bool = False) -> None:
    from dayzero.kernels.moe_decode import DecodeConfig, choose_decode_config, decode_gemm, quantize_rows
    from dayzero.kernels.moe_dispatch import dispatch
    from dayzero.kernels.moe_gemm import choose_config
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = random_experts(E, H, I, bias, gen)
    sets = mxfp4_copies(base, copies)
    ws = [words(e) for e in sets]
    mx = lambda n, kk: n * kk * 17 // 32  # noqa: E731  MXFP4 bytes of one expert's [n, kk] matrix
    for T in TOKENS if not extra_only else ():
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
        rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
        distinct = int(torch.unique(ids).numel())
        b1, b2 = distinct * mx(2 * I, H), distinct * mx(H, I)
        xq, xs = quantize_rows(x)
        if pdl_ab:  # the default layer without and with programmatic dependent launch, twice each
            for _ in range(2):
                for value in ("0", "1"):
                    os.environ[PDL_ENV] = value
                    label = f"PDL {'on' if value == '1' else 'off'}"
                    cfg = choose_decode_config(T, T * k, E, H, I)
                    layer_rows(name, T, {label: cfg}, x, ids, rw, sets, act, copies, reps, bw, b1 + b2, distinct,
                               rows)
                    us8 = graph_replay_us(lambda s: moe_experts_mxfp4(x, ids, rw, sets[s], act, configs=cfg), copies,
                                          reps, per_graph=8)
                    rows.append({"model": name, "tokens": T, "gemm": "layer x8", "label": label, "us": us8,
                                 "bw_pct": 100 * (b1 + b2) / (us8 * 1e-6) / bw})
                    print(f"{name:>13} T={T:>3} layer {label:>11}: {us8:8.1f} us per layer, 8 per graph "
                          f"{rows[-1]['bw_pct']:5.1f}% copy BW", flush=True)
            os.environ.pop(PDL_ENV)
            continue
        best = {}
        for bm in BLOCK_MS[T]:
            d = dispatch(ids, E, bm)
            g1 = lambda s, t: decode_gemm(xq, xs, ws[s][0], ws[s][1], base.b13, d, out_features=I, gather=True,  # noqa: E731
                                          activation=_act(act), alpha=act.alpha or 1.0, limit=act.limit,
                                          block_n=t[0], block_k=t[1], num_warps=t[2], stages=(t + (0,))[3])
            hq, hs = g1(0, GEMM1_TILES[0])
            g2 = lambda s, t: decode_gemm(hq, hs, ws[s][2], ws[s][3], base.b2, d, out_features=H, gather=False,  # noqa: E731
                                          router_weights=rw.view(-1), block_n=t[0], block_k=t[1], num_warps=t[2],
                                          stages=(t + (0,))[3])
            for which, tiles, fn, nbytes in ((1, GEMM1_TILES, g1, b1), (2, GEMM2_TILES, g2, b2)):
                for t in tiles:
                    us = graph_replay_us(lambda s: fn(s, t), copies, reps)
                    pct = 100 * nbytes / (us * 1e-6) / bw
                    st = (t + (0,))[3]
                    rows.append({"model": name, "tokens": T, "gemm": which, "block_m": bm, "block_n": t[0],
                                 "block_k": t[1], "num_warps": t[2], "stages": st, "us": us, "bw_pct": pct})
                    print(f"{name:>13} T={T:>3} gemm{which} bm={bm} bn={t[0]:>3} bk={t[1]} w={t[2]} st={st}: "
                          f"{us:8.1f} us {pct:5.1f}% copy BW", flush=True)
                    key = (bm, which)
                    if key not in best or us < best[key][0]:
                        best[key] = (us, t)
        bm_best = min(BLOCK_MS[T], key=lambda bm: best[(bm, 1)][0] + best[(bm, 2)][0])
        (_, t1), (_, t2) = best[(bm_best, 1)], best[(bm_best, 2)]
        pairs = T * k
        layers = {
            "default": choose_decode_config(T, pairs, E, H, I),
            "best": DecodeConfig(bm_best, t1[0], t2[0], t1[1], t2[1], t1[2], t2[2],
                                 stages1=(t1 + (0,))[3], stages2=(t2 + (0,))[3]),
            "tensor-core": (choose_config(pairs, E, I, True, True), choose_config(pairs, E, H, True, False)),
        }
        layer_rows(name, T, layers, x, ids, rw, sets, act, copies, reps, bw, b1 + b2, distinct, rows)
    # Past 32 tokens: the decode kernels (tiles of 32 tokens) against the tensor-core kernel
    for T in EXTRA_TOKENS if not pdl_ab else ():
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
        rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
        distinct = int(torch.unique(ids).numel())
        layers = {"decode": choose_decode_config(T, T * k, E, H, I) or DecodeConfig(4, 32, 64, 256, 256, 4, 4,
                                                                                    stages1=3, stages2=3),
                  "tensor-core": (choose_config(T * k, E, I, True, True), choose_config(T * k, E, H, True, False))}
        nbytes = distinct * (mx(2 * I, H) + mx(H, I))
        layer_rows(name, T, layers, x, ids, rw, sets, act, copies, reps, bw, nbytes, distinct, rows)


def down_variants(T: int, cfg) -> dict:
    """The default decode layer against variants of its down GEMM (split K with combine_partials,
    narrower or wider programs) and a 2-way gate/up split."""
    import dataclasses

    return {"default": cfg, "down split 2": dataclasses.replace(cfg, split_k2=2),
            "down split 3": dataclasses.replace(cfg, split_k2=3),
            "down 16x1024": dataclasses.replace(cfg, block_n2=16, block_k2=1024),
            "down 8 warps": dataclasses.replace(cfg, num_warps2=8),
            "gate/up split 2": dataclasses.replace(cfg, split_k1=2)}


def early_variants(T: int, cfg) -> dict:
    """The default decode layer against down GEMMs that load their first weight tiles before the PDL wait
    (the hand prefetch, stages 0, early2: its two tiles, into registers), with the pair-order
    dispatch (block_m 1) and without, and gate/up GEMMs that do the same (pair order)."""
    import dataclasses

    r = dataclasses.replace
    hand = r(cfg, stages2=0, early2=True)
    downs = {"": hand, " 16x1024x8": r(hand, block_n2=16, block_k2=1024, num_warps2=8),
             " 32x1024x8": r(hand, block_k2=1024, num_warps2=8), " 32x512x8": r(hand, num_warps2=8),
             " 16x512x4": r(hand, block_n2=16)}
    out = {"default": cfg}
    out.update({f"down{k} hand early": v for k, v in downs.items()})
    if cfg.block_m == 1:
        out.update({f"pair down{k} hand early": r(v, pair_order=True) for k, v in downs.items()})
        out.update({"pair gate/up 32x1024x16 hand early": r(hand, pair_order=True, block_n1=32, block_k1=1024,
                                                           num_warps1=16, stages1=0, early1=True),
                    "pair gate/up 32x512x8 hand early": r(hand, pair_order=True, block_n1=32, block_k1=512,
                                                          num_warps1=8, stages1=0, early1=True)})
        # narrower K tiles: fewer registers (64 at 32 x 256 x 8, sm_90), all 360 gpt-oss programs in one wave
        for bk, w in ((256, 8), (256, 4)):
            out[f"pair gate/up 32x{bk}x{w} hand early"] = r(cfg, pair_order=True, block_n1=32, block_k1=bk,
                                                            num_warps1=w, stages1=0, early1=True)
    return out


def stages_variants(T: int, cfg) -> dict:
    """The default decode layer against deeper software pipelines (more weight tiles in flight per program)
    for its pipelined GEMMs."""
    import dataclasses

    r = dataclasses.replace
    out = {"default": cfg}
    for n in (4, 5, 6):
        out[f"gate/up {n} stages"] = r(cfg, stages1=n)
        if cfg.stages2:
            out[f"down {n} stages"] = r(cfg, stages2=n)
    return out


def plain_variants(T: int, cfg) -> dict:
    """The default decode layer against GEMMs whose K loop is plain (stages 1: each step loads its tile
    into registers and uses it, no prefetch; latency hidden by the other programs on the SM), with
    several tiles. bench/read_patterns.py found this order of loads the fastest for reading alone."""
    import dataclasses

    r = dataclasses.replace
    out = {"default": cfg}
    for bk, w in ((cfg.block_k1, cfg.num_warps1), (512, 4), (512, 8), (256, 4), (256, 8), (1024, 8)):
        out.setdefault(f"gate/up plain {cfg.block_n1}x{bk}x{w}", r(cfg, stages1=1, block_k1=bk, num_warps1=w))
    if cfg.stages1 and cfg.num_warps1 != 4:
        out["gate/up 4 warps"] = r(cfg, num_warps1=4)
    plain2 = r(cfg, stages2=1, early2=False)
    for bn, bk, w in ((cfg.block_n2, cfg.block_k2, cfg.num_warps2), (32, 512, 4), (32, 1024, 8), (32, 256, 4)):
        out.setdefault(f"down plain {bn}x{bk}x{w}", r(plain2, block_n2=bn, block_k2=bk, num_warps2=w))
    out["both plain"] = r(plain2, stages1=1)
    return out


def tiles_variants(T: int, cfg) -> dict:
    """The default decode layer against other pipelined tiles (BLOCK_N x BLOCK_K x warps, 3 stages) for one
    GEMM at a time: whether the defaults still hold after a change of the kernel's instruction mix."""
    import dataclasses

    r = dataclasses.replace
    out = {"default": cfg}
    for bn, bk, w in ((32, 256, 4), (32, 512, 4), (64, 256, 4), (32, 512, 8), (32, 1024, 8), (64, 512, 8),
                      (64, 128, 4), (64, 128, 8), (32, 128, 4)):  # 128-wide K: K = 2880 wastes 2% (512: 7%)
        if (bn, bk, w) != (cfg.block_n1, cfg.block_k1, cfg.num_warps1) or cfg.stages1 != 3:
            out[f"gate/up {bn}x{bk}x{w}"] = r(cfg, block_n1=bn, block_k1=bk, num_warps1=w, stages1=3, split_k1=1)
    if cfg.stages2:
        for bn, bk, w in ((32, 256, 4), (32, 512, 4), (64, 256, 4), (16, 512, 4), (32, 1024, 8)):
            if (bn, bk, w) != (cfg.block_n2, cfg.block_k2, cfg.num_warps2):
                out[f"down {bn}x{bk}x{w}"] = r(cfg, block_n2=bn, block_k2=bk, num_warps2=w)
    return out


def gluon_variants(T: int, cfg) -> dict:
    """The Triton decode layer ("default": choose_decode_config without gluon) against GEMMs run by
    moe_decode_sm90's Gluon kernel (pair order only; its stages n: n - 1 weight tiles in flight, in
    registers or "smem": through a ring of shared memory), one GEMM at a time and both; "gluon both
    32x256x8 smem s3 / 32x512x8 smem s3" is the one-token default on sm_90 (GLUON_ONE_TOKEN)."""
    import dataclasses

    r = dataclasses.replace
    out = {"default": cfg}
    if not cfg.pair_order:
        return out
    ups = {"32x512x8 s2": (32, 512, 8, 2, False), "32x256x8 smem s2": (32, 256, 8, 2, True),
           "32x256x8 smem s3": (32, 256, 8, 3, True)}
    downs = {"32x1024x8 s2": (32, 1024, 8, 2, False), "32x512x8 smem s3": (32, 512, 8, 3, True),
             "32x512x8 smem s4": (32, 512, 8, 4, True), "32x512x8 smem s5": (32, 512, 8, 5, True),
             "32x256x8 smem s4": (32, 256, 8, 4, True)}
    for label, (bn, bk, w, st, sm) in ups.items():
        out[f"gluon gate/up {label}"] = r(cfg, gluon1=True, block_n1=bn, block_k1=bk, num_warps1=w, stages1=st,
                                          smem1=sm, split_k1=1, early1=False)
    for label, (bn, bk, w, st, sm) in downs.items():
        out[f"gluon down {label}"] = r(cfg, gluon2=True, block_n2=bn, block_k2=bk, num_warps2=w, stages2=st,
                                       smem2=sm, split_k2=1, early2=False)
    for up, down in (("32x256x8 smem s3", "32x512x8 smem s4"), ("32x256x8 smem s3", "32x512x8 smem s3"),
                     ("32x256x8 smem s3", "32x256x8 smem s4"), ("32x256x8 smem s2", "32x512x8 smem s4"),
                     ("32x512x8 s2", "32x1024x8 s2")):
        both = out[f"gluon down {down}"]
        out[f"gluon both {up} / {down}"] = r(both, **{f: getattr(out[f"gluon gate/up {up}"], f) for f in (
            "gluon1", "block_n1", "block_k1", "num_warps1", "stages1", "smem1", "split_k1", "early1")})
    return out


def gluon_tiles_variants(T: int, cfg) -> dict:
    """The one-token Gluon default (GLUON_ONE_TOKEN, "gluon default") against other Gluon tiles for one
    GEMM at a time: 4-warp programs (smaller CTA barriers) and, for the down GEMM, 16 rows per program
    (more programs per SM), each through a shared-memory ring of the given slots; "default" is the Triton layer."""
    import dataclasses

    from dayzero.kernels.moe_decode import GLUON_ONE_TOKEN
    from dayzero.kernels.moe_decode_sm90 import tile_fits

    r = dataclasses.replace
    out = {"default": cfg}
    if not cfg.pair_order:
        return out
    g1, g2 = GLUON_ONE_TOKEN
    dflt = r(cfg, gluon1=True, gluon2=True, split_k1=1, split_k2=1, early1=False, early2=False,
             block_n1=g1[0], block_k1=g1[1], num_warps1=g1[2], stages1=g1[3], smem1=g1[4],
             block_n2=g2[0], block_k2=g2[1], num_warps2=g2[2], stages2=g2[3], smem2=g2[4])
    out["gluon default"] = dflt
    for bn, bk, w, st in ((32, 256, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3), (32, 256, 8, 4), (32, 128, 4, 3)):
        if tile_fits(bn, bk, w):  # (h is quantized per 32 outputs: 32 rows at least)
            out[f"gluon gate/up {bn}x{bk}x{w} smem s{st}"] = r(dflt, block_n1=bn, block_k1=bk, num_warps1=w,
                                                              stages1=st)
    for bn, bk, w, st in ((16, 512, 4, 3), (16, 256, 4, 3), (16, 256, 4, 4), (16, 1024, 8, 3), (32, 512, 4, 3),
                          (16, 512, 8, 3)):
        if tile_fits(bn, bk, w):
            out[f"gluon down {bn}x{bk}x{w} smem s{st}"] = r(dflt, block_n2=bn, block_k2=bk, num_warps2=w,
                                                           stages2=st)
    return out


def narrowk_variants(T: int, cfg) -> dict:
    """The default Triton decode layer (from 8 tokens) against K tiles of 64 codes (two 32-value blocks),
    which tile gpt-oss-120b's K = 2880 exactly (45 steps; the default's last 256- or 512-wide tile overlaps
    the one before), with fewer warps and more stages per program, for each GEMM and both."""
    import dataclasses

    r = dataclasses.replace
    out = {"default": cfg}
    ups = [(32, 64, 1, 4), (64, 64, 1, 4), (64, 64, 2, 4), (64, 64, 1, 6), (32, 64, 1, 8)]
    downs = [(32, 64, 1, 4), (64, 64, 1, 4), (64, 64, 2, 4), (64, 64, 1, 6), (16, 64, 1, 6)]
    for bn, bk, w, st in ups:
        out[f"gate/up {bn}x{bk}x{w} s{st}"] = r(cfg, block_n1=bn, block_k1=bk, num_warps1=w, stages1=st, split_k1=1,
                                               gluon1=False, early1=False)
    for bn, bk, w, st in downs:
        out[f"down {bn}x{bk}x{w} s{st}"] = r(cfg, block_n2=bn, block_k2=bk, num_warps2=w, stages2=st, split_k2=1,
                                            gluon2=False, early2=False)
    for up, down in ((ups[1], downs[1]), (ups[2], downs[2]), (ups[3], downs[3])):
        out[f"both {'x'.join(map(str, up[:3]))} s{up[3]} / {'x'.join(map(str, down[:3]))} s{down[3]}"] = r(
            out[f"gate/up {up[0]}x{up[1]}x{up[2]} s{up[3]}"], block_n2=down[0], block_k2=down[1], num_warps2=down[2],
            stages2=down[3], split_k2=1, gluon2=False, early2=False)
    return out


VARIANT_SETS = {"narrowk": narrowk_variants, "gluon": gluon_variants, "gluon_tiles": gluon_tiles_variants, "down": down_variants, "early": early_variants, "stages": stages_variants, "plain": plain_variants,
                "tiles": tiles_variants}


def variants_ab(name: str, which: str, reps: int, copies: int, bw: float, rows: list, per_graph: int = 1,
                tokens=TOKENS, others=()) -> None:
    """The default decode layer at `tokens` against VARIANT_SETS[which] (which None: no variants), all timed
    in turn (interleaved_us, per_graph layers per graph replay), with their errors against the exact layer.
    others: (label, module) pairs, other versions of moe_decode.py whose moe_layer_decode with its own
    default config is timed beside this tree's ("<label> default", "this default")."""
    from dayzero.kernels.moe_decode import choose_decode_config
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4, scale_facts

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = random_experts(E, H, I, bias, gen)
    sets = mxfp4_copies(base, copies)
    mx = lambda n, kk: n * kk * 17 // 32  # noqa: E731
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
        rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
        nbytes = int(torch.unique(ids).numel()) * (mx(2 * I, H) + mx(H, I))
        cfg = choose_decode_config(T, T * k, E, H, I)
        variants = VARIANT_SETS[which](T, cfg) if which in VARIANT_SETS else {"default": cfg}
        fns = {label: (lambda s, c=c: moe_experts_mxfp4(x, ids, rw, sets[s], act, configs=c))
               for label, c in variants.items()}
        if others:
            from dayzero.kernels import moe_decode as this

            for label, mod in [(f"{stem} default", m) for stem, m in others] + [("this default", this)]:
                c = mod.choose_decode_config(T, T * k, E, H, I)
                variants[label] = c
                # as moe_experts_mxfp4 calls it, where that version takes the scale check
                extra = ({"normal_scales": scale_facts(base, base.w13_scale, base.w2_scale)[1]}
                         if "normal_scales" in inspect.signature(mod.moe_layer_decode).parameters else {})
                fns[label] = (lambda s, m=mod, c=c, extra=extra: m.moe_layer_decode(
                    x, ids, rw, *words(sets[s]), sets[s].b13, sets[s].b2, act, inter=I, config=c, **extra))
        if which == "normal":  # the default config, with the one-shift E8M0 factor and without
            from dayzero.kernels.moe_decode import moe_layer_decode

            for label, normal in (("exact factors", False), ("one-shift factors", True)):
                variants[label] = cfg
                fns[label] = (lambda s, normal=normal: moe_layer_decode(
                    x, ids, rw, *words(sets[s]), sets[s].b13, sets[s].b2, act, inter=I, config=cfg,
                    normal_scales=normal))
        ref = _experts_reference(x.float(), ids, rw, base, act)
        errs = {label: rel_err(fn(0), ref) for label, fn in fns.items()}
        us = interleaved_us(fns, copies, reps, per_graph)
        for label, t in us.items():
            pct = 100 * nbytes / (t * 1e-6) / bw
            rows.append({"model": name, "tokens": T, "gemm": "layer", "label": label, "config": repr(variants[label]),
                         "us": t, "bw_pct": pct, "err": errs[label], "per_graph": per_graph})
            print(f"{name:>13} T={T:>3} x{per_graph} layer {label:>20}: {t:8.1f} us {pct:5.1f}% copy BW "
                  f"(default / this {us['default'] / t:.2f}) err {errs[label]:.1e}", flush=True)


def parts_ab(name: str, reps: int, copies: int, bw: float, rows: list, per_graph: int = 1, tokens=TOKENS) -> None:
    """The default decode layer against its launches alone and in partial chains (prep, gate/up GEMM, down
    GEMM, combine; inputs made beforehand for every weight copy), all timed in turn: what each launch
    costs inside a graph of per_graph layers, and what the chain adds to the sum of its parts (the waits
    of each launch for all programs of the one before). Split-K configs are not covered; on sm_90 the
    GEMMs are the Gluon kernels where the default config takes them."""
    from dayzero.kernels import moe_decode as md
    from dayzero.kernels.moe_decode_sm90 import available, decode_gemm_sm90
    from dayzero.kernels.moe_dispatch import combine
    from dayzero.kernels.moe_gemm import kernel_activation
    from dayzero.kernels.moe_mxfp4 import scale_facts

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = random_experts(E, H, I, bias, gen)
    sets = mxfp4_copies(base, copies)
    normal = scale_facts(base, base.w13_scale, base.w2_scale)[1]
    kact, alpha = kernel_activation(act)
    mx = lambda n, kk: n * kk * 17 // 32  # noqa: E731
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k].contiguous()
        rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1).contiguous().view(-1)
        distinct = int(torch.unique(ids).numel())
        n1, n2 = distinct * mx(2 * I, H), distinct * mx(H, I)
        cfg = md.choose_decode_config(T, T * k, E, H, I, gluon=available(x.device))
        if cfg.split_k1 > 1 or cfg.split_k2 > 1:
            raise SystemExit("--parts-ab: split-K configs are not covered")
        pair_ids = ids.view(-1) if cfg.pair_order else None

        def prep():
            return md.prep(x, ids, E, cfg.block_m, pair_order=cfg.pair_order)

        def gate_up(s, d, xq, xs):
            w13, s13, _, _ = words(sets[s])
            if cfg.gluon1:
                return decode_gemm_sm90(xq, xs, w13, s13, sets[s].b13, pair_ids, top_k=k, out_features=I,
                                        gather=True, activation=kact, alpha=alpha, limit=act.limit,
                                        block_n=cfg.block_n1, block_k=cfg.block_k1, num_warps=cfg.num_warps1,
                                        stages=cfg.stages1, normal_scales=normal, smem=cfg.smem1)
            return md.decode_gemm(xq, xs, w13, s13, sets[s].b13, d, out_features=I, gather=True, activation=kact,
                                  alpha=alpha, limit=act.limit, block_n=cfg.block_n1, block_k=cfg.block_k1,
                                  num_warps=cfg.num_warps1, stages=cfg.stages1, pair_ids=pair_ids, early=cfg.early1,
                                  normal_scales=normal)

        def down(s, d, hq, hs):
            _, _, w2, s2 = words(sets[s])
            if cfg.gluon2:
                return decode_gemm_sm90(hq, hs, w2, s2, sets[s].b2, pair_ids, top_k=k, out_features=H, gather=False,
                                        router_weights=rw, block_n=cfg.block_n2, block_k=cfg.block_k2,
                                        num_warps=cfg.num_warps2, stages=cfg.stages2, normal_scales=normal,
                                        smem=cfg.smem2)
            return md.decode_gemm(hq.view(-1, I // 2), hs, w2, s2, sets[s].b2, d, out_features=H, gather=False,
                                  router_weights=rw, block_n=cfg.block_n2, block_k=cfg.block_k2,
                                  num_warps=cfg.num_warps2, stages=cfg.stages2, pair_ids=pair_ids, early=cfg.early2,
                                  normal_scales=normal)

        d, xq, xs = prep()
        hs_ = [gate_up(s, d, xq, xs) for s in range(copies)]
        ys = [down(s, d, *hs_[s]) for s in range(copies)]
        torch.cuda.synchronize()
        fns = {
            "layer": lambda s: md.moe_layer_decode(x, ids, rw.view(T, k), *words(sets[s]), sets[s].b13, sets[s].b2,
                                                   act, inter=I, config=cfg, normal_scales=normal),
            "prep": lambda s: prep(),
            "gate/up": lambda s: gate_up(s, d, xq, xs),
            "down": lambda s: down(s, d, *hs_[s]),
            "combine": lambda s: combine(ys[s], d, T, x.dtype),
            "prep+gate/up": lambda s: gate_up(s, *prep()),
            "gate/up+down": lambda s: down(s, d, *gate_up(s, d, xq, xs)),
            "down+combine": lambda s: combine(down(s, d, *hs_[s]), d, T, x.dtype),
            "layer w/o combine": lambda s: (lambda p: down(s, p[0], *gate_up(s, *p)))(prep()),
        }
        us = interleaved_us(fns, copies, reps, per_graph)
        nbytes = {"gate/up": n1, "down": n2, "prep+gate/up": n1, "gate/up+down": n1 + n2, "down+combine": n2,
                  "layer w/o combine": n1 + n2, "layer": n1 + n2}
        parts = us["prep"] + us["gate/up"] + us["down"] + us["combine"]
        for label, t in us.items():
            pct = 100 * nbytes[label] / (t * 1e-6) / bw if label in nbytes else float("nan")
            rows.append({"model": name, "tokens": T, "gemm": "part", "label": label, "config": repr(cfg), "us": t,
                         "bw_pct": pct, "per_graph": per_graph})
            print(f"{name:>13} T={T:>3} x{per_graph} {label:>18}: {t:8.1f} us {pct:5.1f}% copy BW", flush=True)
        print(f"{name:>13} T={T:>3} x{per_graph} sum of the four launches alone {parts:.1f} us, the layer "
              f"{us['layer']:.1f} us", flush=True)


def layer_rows(name, T, layers, x, ids, rw, sets, act, copies, reps, bw, nbytes, distinct, rows) -> None:
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4

    for label, cfg in layers.items():
        us = graph_replay_us(lambda s: moe_experts_mxfp4(x, ids, rw, sets[s], act, configs=cfg), copies, reps)
        pct = 100 * nbytes / (us * 1e-6) / bw
        rows.append({"model": name, "tokens": T, "gemm": "layer", "label": label, "config": repr(cfg), "us": us,
                     "bw_pct": pct, "distinct_experts": distinct})
        print(f"{name:>13} T={T:>3} layer {label:>11}: {us:8.1f} us {pct:5.1f}% copy BW  {cfg}", flush=True)


def profile_model(name: str, reps: int, copies: int) -> None:
    """GPU time of each kernel of the default decode layer (torch.profiler / CUPTI) at 1, 8 and 32 tokens,
    called eagerly and as CUDA-graph replays; for the replays also the span from the first kernel's start
    to the last one's end, against the event-timed replay (the difference is launch latency)."""
    from torch.profiler import ProfilerActivity, profile

    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = random_experts(E, H, I, bias, gen)
    sets = mxfp4_copies(base, copies)
    for T in TOKENS:
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
        rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
        fn = lambda s: moe_experts_mxfp4(x, ids, rw, sets[s], act, path="a")  # noqa: E731
        graphs = []
        for s in range(copies):
            fn(s)
        torch.cuda.synchronize()
        for s in range(copies):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(s)
            graphs.append(g)
        event_us = graph_replay_us(fn, copies, reps)
        for mode, call in (("eager", fn), ("graph", lambda s: graphs[s].replay())):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(reps * copies):
                    call(i % copies)
                    torch.cuda.synchronize()
            kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
            n = len(kernels) // (reps * copies)
            calls = [kernels[i * n:(i + 1) * n] for i in range(reps * copies)]
            per = [statistics.median(c[j].time_range.elapsed_us() for c in calls) for j in range(n)]
            span = statistics.median(c[-1].time_range.end - c[0].time_range.start for c in calls)
            names = [kernels[j].name.split("(")[0][:28] for j in range(n)]
            distinct = int(torch.unique(ids).numel())
            mb = (distinct * 2 * I * H * 17 // 32 / 1e6, distinct * H * I * 17 // 32 / 1e6)
            print(f"{name:>13} T={T:>3} {mode} ({distinct} experts, gate/up {mb[0]:.0f} MB, down {mb[1]:.0f} MB): " +
                  ", ".join(f"{nm} {us:.1f}" for nm, us in zip(names, per)) +
                  f" | sum {sum(per):.1f} us, first start to last end {span:.1f} us" +
                  (f", event-timed replay {event_us:.1f} us" if mode == "graph" else ""), flush=True)
        del graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(LAYERS), choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--precompile", type=int, default=0, metavar="PROCESSES")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--gemm1-tiles", type=tiles_arg, help="BNxBKxWARPS,... (default: the grid above)")
    ap.add_argument("--gemm2-tiles", type=tiles_arg)
    ap.add_argument("--block-m", type=int, nargs="+", help="BLOCK_M values for every token count > 1")
    ap.add_argument("--profile", action="store_true", help="only the per-kernel GPU times of the default layer")
    ap.add_argument("--pdl-ab", action="store_true",
                    help=f"only the default layers at {TOKENS} tokens, with {PDL_ENV}=0 and =1")
    ap.add_argument("--extra-only", action="store_true", help=f"only the layers at {EXTRA_TOKENS} tokens")
    ap.add_argument("--down-ab", action="store_true",
                    help=f"only the default layers at {TOKENS} tokens against variants of the down GEMM, interleaved")
    ap.add_argument("--early-ab", action="store_true",
                    help=f"only the default layers at {TOKENS} tokens against the pair-order dispatch and early "
                         "weight requests, interleaved")
    ap.add_argument("--stages-ab", action="store_true",
                    help="only the default layers against deeper pipelines of their GEMMs, interleaved")
    ap.add_argument("--normal-ab", action="store_true",
                    help="only the default layer with exact E8M0 factors against the one-shift factors (normal scales)")
    ap.add_argument("--tiles-ab", action="store_true",
                    help="only the default layer against other pipelined tiles for either GEMM")
    ap.add_argument("--plain-ab", action="store_true",
                    help="only the default layer against plain K loops (stages 1) for either GEMM, several tiles")
    ap.add_argument("--gluon-ab", action="store_true",
                    help="the default layer against GEMMs run by the Gluon kernel (moe_decode_sm90)")
    ap.add_argument("--gluon-tiles-ab", action="store_true",
                    help="the one-token Gluon default against other Gluon tiles (16 and 8 rows, 4 warps) per GEMM")
    ap.add_argument("--narrowk-ab", action="store_true",
                    help="the default layer against 64-code K tiles (gpt-oss-120b's K = 2880 without an overlap)")
    ap.add_argument("--parts-ab", action="store_true",
                    help="only the default layer against its launches alone and in partial chains")
    ap.add_argument("--old", type=Path, nargs="+", default=[],
                    help="only the default layer against other versions of moe_decode.py's (each labelled by its stem)")
    ap.add_argument("--per-graph", type=int, nargs="+", default=[1],
                    help="layers per CUDA graph in --down-ab / --early-ab (each count in turn)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS),
                    help="token counts of --down-ab / --early-ab / --stages-ab / --old")
    args = ap.parse_args()
    global GEMM1_TILES, GEMM2_TILES
    GEMM1_TILES = args.gemm1_tiles or GEMM1_TILES
    GEMM2_TILES = args.gemm2_tiles or GEMM2_TILES
    if args.block_m:
        for T in BLOCK_MS:
            BLOCK_MS[T] = (1,) if T == 1 else tuple(args.block_m)
    if not torch.cuda.is_available():
        sys.exit("bench/moe_decode.py needs a CUDA device")
    if args.precompile:
        precompile(args.precompile)
        return
    if args.profile:
        for name in args.models:
            profile_model(name, args.reps, args.copies)
        return
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    rows: list[dict] = []
    for name in args.models:
        if args.parts_ab:
            for per_graph in args.per_graph:
                parts_ab(name, args.reps, args.copies, bw, rows, per_graph, args.tokens)
        elif (args.down_ab or args.early_ab or args.stages_ab or args.plain_ab or args.normal_ab or args.tiles_ab
                or args.gluon_ab or args.gluon_tiles_ab or args.narrowk_ab or args.old):
            which = ("narrowk" if args.narrowk_ab else "gluon" if args.gluon_ab else "gluon_tiles" if args.gluon_tiles_ab else "down" if args.down_ab else "early" if args.early_ab else "stages" if args.stages_ab
                     else "plain" if args.plain_ab else "normal" if args.normal_ab else "tiles" if args.tiles_ab
                     else None)
            from bench.moe_decode_ab import load
            others = [(p.stem, load(p, f"moe_decode_{i}")) for i, p in enumerate(args.old)]
            for per_graph in args.per_graph:
                variants_ab(name, which, args.reps, args.copies, bw, rows, per_graph, args.tokens, others)
        else:
            sweep_model(name, args.reps, args.copies, bw, rows, args.extra_only, args.pdl_ab)
        torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps({"copy_bytes_per_s": bw, "rows": rows}, indent=1))
    print("\nlayers:")
    for r in rows:
        if r["gemm"] == "layer":
            print(f"| {r['model']} | {r['tokens']} | {r['label']} | {r['us']:.1f} | {r['bw_pct']:.1f}% | {r['config']} |")


if __name__ == "__main__":
    main()
