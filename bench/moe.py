"""One routed-expert (MoE) layer on the GPU: path A (MXFP4 fused Triton), path B (MXFP4 -> FP8 workspace,
FP8 Triton GEMM), path C (bf16 Triton) and BF16 torch._grouped_mm, against the measured copy bandwidth
and bf16 / FP8 matmul rates.

    python bench/moe.py --quick              # one table: the production op, gpt-oss-20b and DeepSeek-V4
    python bench/moe.py --trees OLD NEW      # the quick table of two checkouts, alternating, one table
    python bench/moe.py                      # both models, tokens 1 8 32 128 512 2048 8192, all paths
    python bench/moe.py --models gpt-oss-120b --tokens 1 32 --reps 20
    python bench/moe.py --paths A B --tokens 512 2048 8192 --prefetch   # path B, and its prefetch

Method (see /work/shared/research/moe_anchor.md): uniform random top-k routing (distinct experts
per token), random E8M0 scales and codes (never zeros); each timed call uses the next of several
weight copies whose total exceeds the L2, so the weights come from HBM; CUDA events, median of
--reps; "graph" = one CUDA-graph replay of the whole layer (dispatch, both GEMMs, combine).
Bandwidth = MXFP4 (or bf16) bytes of the distinct experts the step activates / time, against a
device-to-device copy (bytes read + written). TFLOP/s = 2 * tokens * top_k * 3 * H * I / time.
Error: relative Frobenius error of each path against the exact MXFP4 layer in float32.
Path B (its own table; eager only: it synchronises with the host once per call): "cold" empties the
workspace before each call (host sync + conversion of every active expert + GEMMs), "warm" finds
every expert resident (a workspace of copies x E slots); % FP8 = warm TFLOP/s over a torch._scaled_mm
8192^3 e4m3 product measured in the same run; out-of-window = MXFP4 blocks converted lossily.
"A eager, layer graphs": path A's eager call at up to 32 tokens replaying the layer's CUDA graph
(kernels/moe_graphs.py, the default for eager calls; off for the other columns).
--prefetch: three layers (the weight copies) called in turn for several steps with a workspace of
2.2 layers' active experts, so each step reconverts; time per layer with the prefetch off and on, and
its hit rate, with the routing repeated each step (the best case) and drawn afresh (uniform, the worst).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl


def _tree_from_argv() -> Path:
    """The tree whose dayzero is imported: --tree DIR, else this script's own checkout."""
    if "--tree" in sys.argv:
        return Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()
    return Path(__file__).resolve().parents[1]


sys.path.insert(0, str(_tree_from_argv()))

# The quick table and the tree comparison use only what every tree has: the registry op, ExpertWeights,
# Activation, the reference layer and mxfp4.dequantize. Kernel modules are imported by the detailed runs.
from dayzero.formats import mxfp4  # noqa: E402
from dayzero.ops.moe import Activation, ExpertWeights, _experts_reference  # noqa: E402

MODELS = {  # experts, top_k, hidden, intermediate, activation, biases
    "gpt-oss-20b": (32, 4, 2880, 2880, Activation("swiglu_clamped", alpha=1.702, limit=7.0), True),
    "gpt-oss-120b": (128, 4, 2880, 2880, Activation("swiglu_clamped", alpha=1.702, limit=7.0), True),
    "deepseek-v4": (256, 6, 4096, 2048, Activation("swiglu", limit=10.0), False),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
MULTI_LAYER_MAX_TOKENS = 128  # decode sizes: also timed as several layers in one graph, and the read floor


def median_ms(fn, reps: int, rotate: int) -> float:
    times = []
    for i in range(reps + rotate):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % rotate)
        end.record()
        end.synchronize()
        if i >= rotate:  # the first pass over the copies is warm-up
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """bytes/s of a 2 GiB device-to-device copy, counting bytes read plus written."""
    a = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = median_ms(lambda i: b.copy_(a), 10, 1)
    return 2 * 2**31 / (ms * 1e-3)


def matmul_rate() -> float:
    """FLOP/s of an 8192^3 bf16 matmul on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda i: a @ b, 10, 1)
    return 2 * 8192**3 / (ms * 1e-3)


def fp8_matmul_rate() -> float:
    """FLOP/s of an 8192^3 float8_e4m3fn torch._scaled_mm (tensor-wise scales, bf16 out) on random data."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = median_ms(lambda i: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10, 1)
    return 2 * 8192**3 / (ms * 1e-3)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, PDL: tl.constexpr):
    """Read words [pid * ITERS * BLOCK, +ITERS * BLOCK) of src and store their sum (so the loads stay);
    launched with programmatic dependent launch as the decode layer's kernels are (kernels/pdl.py)."""
    if PDL:  # kernels/pdl.py's start()
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base = tl.program_id(0).to(tl.int64) * (ITERS * BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_floor_us(nbytes: int, reps: int, copies: int, per_graph: int = 1) -> float:
    """Median µs per kernel of CUDA-graph replays of `per_graph` kernels in a row that each only read
    `nbytes` (rotating over `copies` disjoint buffers, as the layers rotate weight copies): what the same
    timing method gives for moving the layer's weight bytes and nothing else, launch latency included."""
    words = max(1, nbytes // 4)
    block, iters = 4096, 2
    grid = triton.cdiv(words, block * iters)
    bufs = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    from dayzero.kernels import pdl

    run = lambda s: _read_kernel[(grid,)](bufs[s], out, words, BLOCK=block, ITERS=iters, num_warps=8,  # noqa: E731
                                          **pdl.launch_options(out.device))
    return graph_replay_us(run, copies, reps, per_graph)


def capture_graphs(fn, copies: int, per_graph: int = 1) -> list:
    """One CUDA graph per starting copy s of fn(s), fn(s + 1), ... (per_graph calls in a row, copies
    rotating), captured on a side stream after one eager call per copy."""
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in range(copies):
            fn(s)
        for s in range(copies):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for j in range(per_graph):
                    fn((s + j) % copies)
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(stream)
    return graphs


def graph_replay_us(fn, copies: int, reps: int, per_graph: int = 1) -> float:
    """Median µs per call of fn(copy) captured `per_graph` times in a row (copies rotating) in one CUDA
    graph, one graph per starting copy, timed replay by replay: per_graph = 1 is one layer per replay
    (its launch latency included), larger values are how an engine's decode graph runs many layers."""
    graphs = capture_graphs(fn, copies, per_graph)
    us = 1e3 * median_ms(lambda s: graphs[s].replay(), reps, copies) / per_graph
    del graphs
    return us


def mxfp4_copies(base: ExpertWeights, copies: int) -> list[ExpertWeights]:
    """base and copies - 1 clones of its MXFP4 weights (biases shared), so that timed calls can rotate over
    more weight bytes than L2 holds."""
    return [base] + [ExpertWeights("mxfp4", *(t.clone() for t in (base.w13, base.w2, base.w13_scale, base.w2_scale)),
                                   base.b13, base.b2) for _ in range(copies - 1)]


def random_experts(E, H, I, bias, gen) -> ExpertWeights:
    def mx(n, k):
        blocks = torch.randint(0, 256, (E, n, k // 32, 16), dtype=torch.uint8, device="cuda", generator=gen)
        scales = torch.randint(119, 125, (E, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        return blocks, scales

    w13, s13 = mx(2 * I, H)
    w2, s2 = mx(H, I)
    b13 = torch.randn(E, 2 * I, device="cuda", generator=gen).bfloat16() * 0.5 if bias else None
    b2 = torch.randn(E, H, device="cuda", generator=gen).bfloat16() * 0.5 if bias else None
    return ExpertWeights("mxfp4", w13, w2, s13, s2, b13, b2)


def to_bf16(e: ExpertWeights) -> ExpertWeights:
    def deq(b, s):
        return torch.stack([mxfp4.dequantize(b[i], s[i], torch.bfloat16) for i in range(b.shape[0])])

    return ExpertWeights("bf16", deq(e.w13, e.w13_scale), deq(e.w2, e.w2_scale), b13=e.b13, b2=e.b2)


def grouped_mm_layer(x, ids, weights, e: ExpertWeights, act: Activation):
    """BF16 layer with torch._grouped_mm (the anchor's baseline B): sort, gather, GEMM, activation,
    GEMM, un-permute, weighted sum over the k slots. No host synchronisation."""
    T, k = ids.shape
    E = e.w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, e.w13.transpose(1, 2), offs=offs)
    if e.b13 is not None:
        h = h + e.b13[flat[order]]
    gate, up = h.float().chunk(2, dim=-1)
    a = act(gate, up).to(torch.bfloat16)
    y = torch._grouped_mm(a, e.w2.transpose(1, 2), offs=offs)
    if e.b2 is not None:
        y = y + e.b2[flat[order]]
    out = torch.empty_like(y)
    out[order] = y
    return (out.view(T, k, -1).float() * weights[..., None]).sum(1).to(x.dtype)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_model(name: str, tokens_list, reps: int, copies: int, l2_bytes: int, bw: float, flops: float, out_rows: list,
                paths: tuple[str, ...], fp8_flops: float = 0.0, prefetch: bool = False, sweep: bool = False,
                per_graph: int = 1):
    from dayzero.kernels import moe_graphs
    from dayzero.kernels.moe_bf16 import moe_experts_bf16
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = 3 * H * I
    mx_bytes = params * 17 // 32  # codes + E8M0 scales
    bf_bytes = params * 2
    base = random_experts(E, H, I, bias, gen)
    mx_sets = mxfp4_copies(base, copies)
    have_c = "C" in paths or "grouped_mm" in paths
    bf_sets = []
    if have_c:
        bf = to_bf16(base)
        bf_sets = [bf] + [ExpertWeights("bf16", bf.w13.clone(), bf.w2.clone(), b13=bf.b13, b2=bf.b2) for _ in range(copies - 1)]
    print(f"\n{name}: {E} experts, top-{k}, hidden {H}, intermediate {I}; resident bytes per expert: "
          f"MXFP4 {mx_bytes / 2**20:.2f} MiB, bf16 {bf_bytes / 2**20:.2f} MiB; {copies} weight copies "
          f"({copies * E * mx_bytes / 1e9:.1f} GB MXFP4) vs L2 {l2_bytes / 1e6:.0f} MB", flush=True)
    fns = {
        "A": lambda x, i, w, s: moe_experts_mxfp4(x, i, w, mx_sets[s], act, path="a"),
        "C": lambda x, i, w, s: moe_experts_bf16(x, i, w, bf_sets[s], act),
        "grouped_mm": lambda x, i, w, s: grouped_mm_layer(x, i, w, bf_sets[s], act),
    }
    fns = {p: f for p, f in fns.items() if p in paths}
    ws = None
    if "B" in paths:
        from dayzero.kernels.fp8_workspace import Fp8Workspace, expert_slot_bytes

        ws = Fp8Workspace(copies * E * expert_slot_bytes(I, H), "cuda", prefetch=False)
        print(f"path B: FP8 expert {expert_slot_bytes(I, H) / 2**20:.2f} MiB, workspace {ws.capacity_bytes / 2**30:.1f} GiB",
              flush=True)
    for T in tokens_list:
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
        w = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
        distinct = int(torch.unique(ids).numel())
        ref = _experts_reference(x.float(), ids, w, base, act)
        row = {"model": name, "tokens": T, "distinct_experts": distinct}
        for p, fn in fns.items():
            out = fn(x, ids, w, 0)
            row[f"err_{p}"] = rel_err(out, ref)
            row[f"eager_us_{p}"] = 1e3 * median_ms(lambda s: fn(x, ids, w, s), reps, copies)
            row[f"graph_us_{p}"] = graph_replay_us(lambda s: fn(x, ids, w, s), copies, reps)
            t = row[f"graph_us_{p}"] * 1e-6
            nbytes = distinct * (mx_bytes if p == "A" else bf_bytes)
            row[f"bw_pct_{p}"] = 100 * nbytes / t / bw
            row[f"tflops_{p}"] = 2 * T * k * params / t / 1e12
            if per_graph > 1 and T <= MULTI_LAYER_MAX_TOKENS:
                us = graph_replay_us(lambda s: fn(x, ids, w, s), copies, reps, per_graph)
                row[f"graphn_us_{p}"] = us
                row[f"graphn_bw_pct_{p}"] = 100 * nbytes / (us * 1e-6) / bw
            if p == "A" and T <= moe_graphs.DEFAULT_MAX_TOKENS:  # the eager call replaying its layer graphs
                os.environ[moe_graphs.GRAPHS_ENV] = "1"
                for s in range(2 * copies):  # per copy: one eager call, then the capture
                    fn(x, ids, w, s % copies)
                row["err_lg_A"] = rel_err(fn(x, ids, w, 0), ref)
                row["eager_lg_us_A"] = 1e3 * median_ms(lambda s: fn(x, ids, w, s), reps, copies)
                os.environ[moe_graphs.GRAPHS_ENV] = "0"
            if p == "A" and T <= MULTI_LAYER_MAX_TOKENS:
                row["floor_us_A"] = read_floor_us(nbytes, reps, copies)
                row["floor_bw_pct_A"] = 100 * nbytes / (row["floor_us_A"] * 1e-6) / bw
                if per_graph > 1:
                    row["floorn_us_A"] = read_floor_us(nbytes, reps, copies, per_graph)
                    row["floorn_bw_pct_A"] = 100 * nbytes / (row["floorn_us_A"] * 1e-6) / bw
        if "A" in fns and "C" in fns:
            row["A_over_C"] = row["graph_us_A"] / row["graph_us_C"]
        if ws is not None:
            bench_path_b(row, ws, mx_sets, x, ids, w, act, ref, reps, copies, 2 * T * k * params,
                         distinct * (mx_bytes + expert_slot_bytes(I, H)), bw, fp8_flops, b_sweep(T, k, E, I, H) if sweep else ())
            if prefetch:
                bench_prefetch(row, mx_sets, x, ids, w, act, T, E, k, I, H, gen)
            if "A" in fns:
                row["A_over_B_cold"] = row["eager_us_A"] / row["cold_us_B"]
                row["A_over_B_warm"] = row["eager_us_A"] / row["warm_us_B"]
        out_rows.append(row)
        print(format_row(row, fns), flush=True)
        if ws is not None:
            print("    " + format_b(row), flush=True)


def bench_path_b(row, ws, mx_sets, x, ids, w, act, ref, reps, copies, flop, convert_bytes, bw, fp8_flops, sweep):
    from dayzero.kernels.moe_fp8 import moe_experts_mxfp4_fp8

    def cold(s):
        ws.clear()
        return moe_experts_mxfp4_fp8(x, ids, w, mx_sets[s], act, ws)

    ws.clear()
    ws.reset_stats()
    out = cold(0)
    row["oow_B"] = ws.stats.out_of_window_blocks
    row["err_B"] = rel_err(out, ref)
    row["cold_us_B"] = 1e3 * median_ms(cold, reps, copies)
    row["warm_us_B"] = 1e3 * median_ms(lambda s: moe_experts_mxfp4_fp8(x, ids, w, mx_sets[s], act, ws), reps, copies)
    t = row["warm_us_B"] * 1e-6
    row["tflops_B"] = flop / t / 1e12
    row["fp8_pct_B"] = 100 * flop / t / fp8_flops
    row["convert_bw_pct_B"] = 100 * convert_bytes / ((row["cold_us_B"] - row["warm_us_B"]) * 1e-6) / bw
    for c1, c2 in sweep:  # tile sweep (--b-sweep): warm time per config pair
        us = 1e3 * median_ms(lambda s: moe_experts_mxfp4_fp8(x, ids, w, mx_sets[s], act, ws, configs=(c1, c2)), reps, copies)
        print(f"    sweep B T={x.shape[0]} {c1} {c2}: {us:.1f} us", flush=True)


def b_sweep(T, k, E, I, H):
    """Path B tile pairs to time (--b-sweep): the default and its neighbours."""
    from dayzero.kernels.moe_fp8 import choose_fp8_configs
    from dayzero.kernels.moe_gemm import GemmConfig

    pairs = [choose_fp8_configs(T * k, E, I, H)]
    for bm, warps, stages, bn2 in ((16, 4, 4, 64), (32, 8, 3, 128), (64, 8, 3, 128), (64, 8, 4, 128)):
        pairs.append((GemmConfig(bm, 128, 128, warps, stages), GemmConfig(bm, bn2, 128, warps, stages)))
    return pairs


def bench_prefetch(row, mx_sets, x, ids, w, act, T, E, k, I, H, gen):
    """Steady-state time per layer over three layers with a workspace of 2.2 layers' active experts."""
    from dayzero.kernels.fp8_workspace import Fp8Workspace, expert_slot_bytes
    from dayzero.kernels.moe_fp8 import moe_experts_mxfp4_fp8

    steps = 6
    fresh = [[torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k] for _ in mx_sets] for _ in range(steps)]
    for routing in ("same", "fresh"):
        route = (lambda step, layer: ids) if routing == "same" else (lambda step, layer: fresh[step][layer])
        active = max(int(torch.unique(route(s, l)).numel()) for s in range(steps) for l in range(len(mx_sets)))
        for on in (False, True):
            ws = Fp8Workspace(int(2.2 * active) * expert_slot_bytes(I, H), "cuda", prefetch=on)
            times = []
            for step in range(steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for layer, experts in enumerate(mx_sets):
                    moe_experts_mxfp4_fp8(x, route(step, layer), w, experts, act, ws)
                end.record()
                end.synchronize()
                if step >= 2:  # step 0 learns the call order, step 1 is the first that prefetches
                    times.append(start.elapsed_time(end) / len(mx_sets))
            key = f"prefetch_{'on' if on else 'off'}_{routing}"
            row[f"{key}_us"] = 1e3 * statistics.median(times)
            if on:
                row[f"prefetch_hit_rate_{routing}"] = ws.stats.prefetch_hit_rate


def format_b(r: dict) -> str:
    line = (f"B: cold {r['cold_us_B']:8.1f} warm {r['warm_us_B']:8.1f} us {r['tflops_B']:6.1f} TF ({r['fp8_pct_B']:4.1f}% fp8) "
            f"convert {r['convert_bw_pct_B']:4.1f}% BW err {r['err_B']:.1e} out-of-window {r['oow_B']}")
    if "A_over_B_cold" in r:
        line += f" | A/B cold {r['A_over_B_cold']:.2f} warm {r['A_over_B_warm']:.2f}"
    for routing in ("same", "fresh"):
        if f"prefetch_on_{routing}_us" in r:
            line += (f" | prefetch ({routing} routing) off {r[f'prefetch_off_{routing}_us']:.1f} on "
                     f"{r[f'prefetch_on_{routing}_us']:.1f} us/layer, hit rate {r[f'prefetch_hit_rate_{routing}']:.2f}")
    return line


def markdown_b(rows) -> str:
    head = ["model", "T", "experts", "A eager µs", "B cold µs", "B warm µs", "B TFLOP/s (% FP8)", "B conversion % copy BW",
            "B rel err", "out-of-window blocks", "A/B cold", "A/B warm"]
    prefetch = any("prefetch_on_same_us" in r for r in rows)
    if prefetch:
        head += ["prefetch off/on µs per layer (same routing)", "hit rate", "prefetch off/on µs (fresh routing)", "hit rate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "cold_us_B" not in r:
            continue
        cells = [r["model"], str(r["tokens"]), str(r["distinct_experts"]),
                 f"{r['eager_us_A']:.1f}" if "eager_us_A" in r else "-", f"{r['cold_us_B']:.1f}", f"{r['warm_us_B']:.1f}",
                 f"{r['tflops_B']:.1f} ({r['fp8_pct_B']:.0f}%)", f"{r['convert_bw_pct_B']:.0f}%", f"{r['err_B']:.1e}",
                 str(r["oow_B"]), f"{r.get('A_over_B_cold', float('nan')):.2f}", f"{r.get('A_over_B_warm', float('nan')):.2f}"]
        if prefetch:
            for routing in ("same", "fresh"):
                cells += [f"{r[f'prefetch_off_{routing}_us']:.0f} / {r[f'prefetch_on_{routing}_us']:.0f}",
                          f"{r[f'prefetch_hit_rate_{routing}']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_row(r: dict, paths) -> str:
    parts = [f"{r['model']:>13} T={r['tokens']:>5} experts={r['distinct_experts']:>3}"]
    for p in paths:
        parts.append(f"{p}: eager {r[f'eager_us_{p}']:8.1f} graph {r[f'graph_us_{p}']:8.1f} us "
                     f"{r[f'bw_pct_{p}']:5.1f}% BW {r[f'tflops_{p}']:6.1f} TF err {r[f'err_{p}']:.1e}")
    if "A_over_C" in r:
        parts.append(f"A/C {r['A_over_C']:.2f}")
    if "eager_lg_us_A" in r:
        parts.append(f"A eager with layer graphs {r['eager_lg_us_A']:.1f} us (err {r['err_lg_A']:.1e})")
    for p in paths:
        if f"graphn_us_{p}" in r:
            parts.append(f"{p} in a multi-layer graph {r[f'graphn_us_{p}']:.1f} us/layer ({r[f'graphn_bw_pct_{p}']:.1f}% BW)")
    if "floor_us_A" in r:
        parts.append(f"read floor of A's bytes {r['floor_us_A']:.1f} us ({r['floor_bw_pct_A']:.1f}% BW)")
    if "floorn_us_A" in r:
        parts.append(f"in a multi-kernel graph {r['floorn_us_A']:.1f} us/kernel ({r['floorn_bw_pct_A']:.1f}% BW)")
    return " | ".join(parts)


def markdown(rows, bw, flops, paths) -> str:
    head = ["model", "T", "experts"]
    for p in paths:
        head += [f"{p} eager µs", f"{p} graph µs", f"{p} % copy BW", f"{p} TFLOP/s (% bf16)", f"{p} rel err"]
    if "A" in paths and "C" in paths:
        head.append("A/C (graph)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], str(r["tokens"]), str(r["distinct_experts"])]
        for p in paths:
            tf = r[f"tflops_{p}"]
            cells += [f"{r[f'eager_us_{p}']:.1f}", f"{r[f'graph_us_{p}']:.1f}", f"{r[f'bw_pct_{p}']:.1f}%",
                      f"{tf:.1f} ({100 * tf * 1e12 / flops:.0f}%)", f"{r[f'err_{p}']:.1e}"]
        if "A_over_C" in r:
            cells.append(f"{r['A_over_C']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_decode(rows, paths, per_graph: int) -> str:
    """Decode sizes: one layer per graph replay, `per_graph` layers per replay (per layer), and the read
    floor of path A's bytes (a kernel that only reads them: one per replay, and per_graph per replay)."""
    head = ["model", "T"]
    for p in paths:
        head += [f"{p} graph µs (1 layer)", f"{p} µs/layer ({per_graph} per graph)", f"{p} % copy BW ({per_graph} per graph)"]
    head += ["read floor µs (A's bytes, 1 kernel)", "floor % copy BW",
             f"read floor µs ({per_graph} per graph)", f"floor % copy BW ({per_graph} per graph)",
             "A eager µs", "A eager µs, layer graphs (speed-up)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "floor_us_A" not in r and not any(f"graphn_us_{p}" in r for p in paths):
            continue
        cells = [r["model"], str(r["tokens"])]
        for p in paths:
            cells += [f"{r[f'graph_us_{p}']:.1f}", f"{r.get(f'graphn_us_{p}', float('nan')):.1f}",
                      f"{r.get(f'graphn_bw_pct_{p}', float('nan')):.1f}%"]
        cells += [f"{r.get('floor_us_A', float('nan')):.1f}", f"{r.get('floor_bw_pct_A', float('nan')):.1f}%",
                  f"{r.get('floorn_us_A', float('nan')):.1f}", f"{r.get('floorn_bw_pct_A', float('nan')):.1f}%"]
        if "eager_lg_us_A" in r:
            cells += [f"{r['eager_us_A']:.1f}", f"{r['eager_lg_us_A']:.1f} ({r['eager_us_A'] / r['eager_lg_us_A']:.1f}x)"]
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the quick table, and one tree against another ------------------------------------------------

QUICK_MODELS = ("gpt-oss-20b", "deepseek-v4")
QUICK_TOKENS = (1, 8, 32, 128, 8192)


def chosen_kernel(x, ids, experts, act) -> str:
    """The kernel variant this tree's chooser picks for the call ('-' where the tree has no chooser)."""
    try:
        from dayzero.kernels.moe import plan_for
    except ImportError:
        return "-"
    return plan_for(x, ids, experts, act).kernel


def quick(models, tokens_list, reps: int, copies: int) -> dict:
    """Per model and token count: the registry op moe_experts_mxfp4 as the engine calls it (eager; at
    decode sizes it replays its layer graphs) and as one CUDA-graph replay, the bf16 torch._grouped_mm
    layer (baseline), and the roofline: the larger of the active experts' MXFP4 bytes at copy bandwidth
    and the FLOPs at the bf16 matmul rate."""
    from dayzero import ops

    props = torch.cuda.get_device_properties(0)
    bw, flops = copy_bandwidth(), matmul_rate()
    info = {"device": props.name, "date": str(datetime.date.today()), "torch": torch.__version__,
            "triton": triton.__version__, "copy_bytes_per_s": bw, "bf16_flops": flops, "rows": []}
    for name in models:
        E, k, H, I, act, bias = MODELS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = 3 * H * I
        base = random_experts(E, H, I, bias, gen)
        mx_sets = mxfp4_copies(base, copies)
        bf = to_bf16(base)
        bf_sets = [bf] + [ExpertWeights("bf16", bf.w13.clone(), bf.w2.clone(), b13=bf.b13, b2=bf.b2)
                          for _ in range(copies - 1)]
        for T in tokens_list:
            x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
            ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
            w = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
            distinct = int(torch.unique(ids).numel())
            ref = _experts_reference(x.float(), ids, w, base, act)
            ours = lambda s: ops.moe_experts_mxfp4(x, ids, w, mx_sets[s], act)  # noqa: E731
            base_fn = lambda s: grouped_mm_layer(x, ids, w, bf_sets[s], act)  # noqa: E731
            row = {"model": name, "tokens": T, "experts": distinct, "kernel": chosen_kernel(x, ids, base, act),
                   "err": rel_err(ours(0), ref), "err_baseline": rel_err(base_fn(0), ref)}
            for s in range(2 * copies):  # compiles, and lets eager decode calls capture their layer graphs
                ours(s % copies)
            row["eager_us"] = 1e3 * median_ms(ours, reps, copies)
            row["graph_us"] = graph_replay_us(ours, copies, reps)
            row["baseline_us"] = graph_replay_us(base_fn, copies, reps)
            row["roofline_us"] = 1e6 * max(distinct * params * 17 / 32 / bw, 2 * T * k * params / flops)
            info["rows"].append(row)
            print(f"{name:>12} T={T:>5} {row['kernel']:>11}: eager {row['eager_us']:9.1f} graph {row['graph_us']:9.1f} "
                  f"grouped_mm {row['baseline_us']:9.1f} roofline {row['roofline_us']:8.1f} us, err {row['err']:.1e}",
                  flush=True)
        del mx_sets, bf_sets, base, bf
        torch.cuda.empty_cache()
    return info


def markdown_quick(info: dict) -> str:
    head = ["model", "T", "experts", "kernel", "ours eager µs", "ours graph µs", "grouped_mm bf16 graph µs",
            "roofline µs", "roofline / ours (graph)", "ours rel err"]
    lines = [f"{info['date']} {info['device']}, torch {info['torch']}, Triton {info['triton']}; copy "
             f"{info['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), bf16 matmul {info['bf16_flops'] / 1e12:.0f} TFLOP/s",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in info["rows"]:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['experts']} | {r['kernel']} | {r['eager_us']:.1f} | "
                     f"{r['graph_us']:.1f} | {r['baseline_us']:.1f} | {r['roofline_us']:.1f} | "
                     f"{r['roofline_us'] / r['graph_us']:.0%} | {r['err']:.1e} |")
    return "\n".join(lines)


def compare_trees(trees: list[Path], rounds: int, passthrough: list[str]) -> None:
    """Run the quick table of each tree in its own process (this script, with --tree), the trees
    alternating for `rounds` rounds, and print one table: each tree's median eager and graph times and
    their ratio to the first tree's."""
    runs: dict[int, list[dict]] = {i: [] for i in range(len(trees))}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            for i, tree in enumerate(trees):
                out = Path(tmp) / f"{rnd}-{i}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--quick", "--tree", str(tree), "--json", str(out),
                       *passthrough]
                print(f"round {rnd + 1}/{rounds}: {tree}", flush=True)
                subprocess.run(cmd, check=True)
                runs[i].append(json.loads(out.read_text()))

    def med(i, key, model, T):
        return statistics.median(r[key] for run in runs[i] for r in run["rows"] if (r["model"], r["tokens"]) == (model, T))

    first = runs[0][0]
    print(f"\n{first['date']} {first['device']}, torch {first['torch']}, Triton {first['triton']}; medians over "
          f"{rounds} round(s) of each tree, the trees alternating")
    for i, tree in enumerate(trees):
        print(f"  tree {i}: {tree}")
    head = ["model", "T"] + [f"tree {i} {what}" for what in ("eager µs", "graph µs") for i in range(len(trees))]
    head += [f"tree {i}/0 {what}" for what in ("eager", "graph") for i in range(1, len(trees))]
    head += [f"tree {i} kernel" for i in range(len(trees))]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in first["rows"]:
        m, T = r["model"], r["tokens"]
        cells = [m, str(T)]
        for key in ("eager_us", "graph_us"):
            cells += [f"{med(i, key, m, T):.1f}" for i in range(len(trees))]
        for key in ("eager_us", "graph_us"):
            cells += [f"{med(i, key, m, T) / med(0, key, m, T):.3f}" for i in range(1, len(trees))]
        cells += [next(x["kernel"] for x in runs[i][0]["rows"] if (x["model"], x["tokens"]) == (m, T))
                  for i in range(len(trees))]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--paths", nargs="+", default=["A", "B", "C", "grouped_mm"], choices=["A", "B", "C", "grouped_mm"])
    ap.add_argument("--prefetch", action="store_true", help="path B: also time the prefetch policy over three layers")
    ap.add_argument("--b-sweep", action="store_true", help="path B: also time a few GEMM tile configurations")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copies", type=int, default=3, help="weight copies rotated per call (total must exceed L2)")
    ap.add_argument("--json", type=Path, help="write the raw rows here")
    ap.add_argument("--layers-per-graph", type=int, default=8,
                    help=f"up to {MULTI_LAYER_MAX_TOKENS} tokens: also time this many layer calls in one graph")
    ap.add_argument("--quick", action="store_true",
                    help=f"one table: the production op at {' '.join(map(str, QUICK_TOKENS))} tokens on "
                         f"{' and '.join(QUICK_MODELS)} shapes, against grouped_mm and the roofline")
    ap.add_argument("--tree", type=Path, help="import dayzero from this checkout (default: this script's)")
    ap.add_argument("--trees", nargs="+", type=Path,
                    help="compare the quick tables of these checkouts (one process each, alternating)")
    ap.add_argument("--rounds", type=int, default=2, help="with --trees: rounds over the trees")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe.py needs a CUDA device")
    if args.trees:
        extra = ["--reps", str(args.reps), "--copies", str(args.copies)]
        if "--models" in sys.argv:
            extra += ["--models", *args.models]
        if "--tokens" in sys.argv:
            extra += ["--tokens", *map(str, args.tokens)]
        compare_trees(args.trees, args.rounds, extra)
        return
    if args.quick:
        models = args.models if "--models" in sys.argv else list(QUICK_MODELS)
        tokens = args.tokens if "--tokens" in sys.argv else list(QUICK_TOKENS)
        info = quick(models, tokens, args.reps, args.copies)
        print("\n" + markdown_quick(info))
        if args.json:
            args.json.write_text(json.dumps(info, indent=1))
        return
    from dayzero.kernels import moe_graphs

    # "eager" is the plain eager call; path A's eager call replaying its layer graphs is timed apart
    os.environ[moe_graphs.GRAPHS_ENV] = "0"
    paths = tuple(p for p in args.paths if p != "grouped_mm" or hasattr(torch, "_grouped_mm"))
    props = torch.cuda.get_device_properties(0)
    bw, flops = copy_bandwidth(), matmul_rate()
    fp8_flops = fp8_matmul_rate() if "B" in paths else 0.0
    print(f"{datetime.date.today()} {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 1e6:.0f} MB; "
          f"torch {torch.__version__}; copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {flops / 1e12:.0f} TFLOP/s, "
          f"fp8 matmul {fp8_flops / 1e12:.0f} TFLOP/s; "
          f"torch._grouped_mm {'present' if hasattr(torch, '_grouped_mm') else 'absent'}", flush=True)
    rows: list[dict] = []
    for name in args.models:
        bench_model(name, args.tokens, args.reps, args.copies, props.L2_cache_size, bw, flops, rows, paths, fp8_flops,
                    args.prefetch, args.b_sweep, args.layers_per_graph)
        torch.cuda.empty_cache()
    table_paths = tuple(p for p in paths if p != "B")
    if table_paths:
        print("\n" + markdown(rows, bw, flops, table_paths))
        if any("floor_us_A" in r or any(f"graphn_us_{p}" in r for p in table_paths) for r in rows):
            print("\n" + markdown_decode(rows, table_paths, args.layers_per_graph))
    if "B" in paths:
        print("\n" + markdown_b(rows))
    if args.json:
        args.json.write_text(json.dumps({"device": props.name, "copy_bytes_per_s": bw, "bf16_flops": flops,
                                         "fp8_flops": fp8_flops, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
