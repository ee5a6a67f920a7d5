"""One routed-expert (MoE) layer on the GPU: path A (MXFP4 fused Triton), path C (bf16 Triton) and
BF16 torch._grouped_mm, against the measured copy bandwidth and bf16 matmul rate.

    python bench/moe.py                      # both models, tokens 1 8 32 128 512 2048 8192
    python bench/moe.py --models gpt-oss-120b --tokens 1 32 --reps 20

Method (see /work/shared/research/moe_anchor.md): uniform random top-k routing (distinct experts
per token), random E8M0 scales and codes (never zeros); each timed call uses the next of several
weight copies whose total exceeds the L2, so the weights come from HBM; CUDA events, median of
--reps; "graph" = one CUDA-graph replay of the whole layer (dispatch, both GEMMs, combine).
Bandwidth = MXFP4 (or bf16) bytes of the distinct experts the step activates / time, against a
device-to-device copy (bytes read + written). TFLOP/s = 2 * tokens * top_k * 3 * H * I / time.
Error: relative Frobenius error of each path against the exact MXFP4 layer in float32.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dayzero.formats import mxfp4  # noqa: E402
from dayzero.ops.moe import Activation, ExpertWeights, _experts_reference  # noqa: E402

MODELS = {  # experts, top_k, hidden, intermediate, activation, biases
    "gpt-oss-120b": (128, 4, 2880, 2880, Activation("swiglu_clamped", alpha=1.702, limit=7.0), True),
    "deepseek-v4": (256, 6, 4096, 2048, Activation("swiglu", limit=10.0), False),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)


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
                paths: tuple[str, ...]):
    from dayzero.kernels.moe_bf16 import moe_experts_bf16
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = 3 * H * I
    mx_bytes = params * 17 // 32  # codes + E8M0 scales
    bf_bytes = params * 2
    base = random_experts(E, H, I, bias, gen)
    mx_sets = [base] + [ExpertWeights("mxfp4", *(t.clone() for t in (base.w13, base.w2, base.w13_scale, base.w2_scale)),
                                      base.b13, base.b2) for _ in range(copies - 1)]
    have_c = "C" in paths or "grouped_mm" in paths
    bf_sets = []
    if have_c:
        bf = to_bf16(base)
        bf_sets = [bf] + [ExpertWeights("bf16", bf.w13.clone(), bf.w2.clone(), b13=bf.b13, b2=bf.b2) for _ in range(copies - 1)]
    print(f"\n{name}: {E} experts, top-{k}, hidden {H}, intermediate {I}; resident bytes per expert: "
          f"MXFP4 {mx_bytes / 2**20:.2f} MiB, bf16 {bf_bytes / 2**20:.2f} MiB; {copies} weight copies "
          f"({copies * E * mx_bytes / 1e9:.1f} GB MXFP4) vs L2 {l2_bytes / 1e6:.0f} MB", flush=True)
    fns = {
        "A": lambda x, i, w, s: moe_experts_mxfp4(x, i, w, mx_sets[s], act),
        "C": lambda x, i, w, s: moe_experts_bf16(x, i, w, bf_sets[s], act),
        "grouped_mm": lambda x, i, w, s: grouped_mm_layer(x, i, w, bf_sets[s], act),
    }
    fns = {p: f for p, f in fns.items() if p in paths}
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
            graphs = []
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for s in range(copies):
                    fn(x, ids, w, s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, stream=stream):
                        fn(x, ids, w, s)
                    graphs.append(g)
            torch.cuda.current_stream().wait_stream(stream)
            row[f"graph_us_{p}"] = 1e3 * median_ms(lambda s: graphs[s].replay(), reps, copies)
            t = row[f"graph_us_{p}"] * 1e-6
            nbytes = distinct * (mx_bytes if p == "A" else bf_bytes)
            row[f"bw_pct_{p}"] = 100 * nbytes / t / bw
            row[f"tflops_{p}"] = 2 * T * k * params / t / 1e12
        if "A" in fns and "C" in fns:
            row["A_over_C"] = row["graph_us_A"] / row["graph_us_C"]
        out_rows.append(row)
        print(format_row(row, fns), flush=True)


def format_row(r: dict, paths) -> str:
    parts = [f"{r['model']:>13} T={r['tokens']:>5} experts={r['distinct_experts']:>3}"]
    for p in paths:
        parts.append(f"{p}: eager {r[f'eager_us_{p}']:8.1f} graph {r[f'graph_us_{p}']:8.1f} us "
                     f"{r[f'bw_pct_{p}']:5.1f}% BW {r[f'tflops_{p}']:6.1f} TF err {r[f'err_{p}']:.1e}")
    if "A_over_C" in r:
        parts.append(f"A/C {r['A_over_C']:.2f}")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--paths", nargs="+", default=["A", "C", "grouped_mm"], choices=["A", "C", "grouped_mm"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copies", type=int, default=3, help="weight copies rotated per call (total must exceed L2)")
    ap.add_argument("--json", type=Path, help="write the raw rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe.py needs a CUDA device")
    paths = tuple(p for p in args.paths if p != "grouped_mm" or hasattr(torch, "_grouped_mm"))
    props = torch.cuda.get_device_properties(0)
    bw, flops = copy_bandwidth(), matmul_rate()
    print(f"{datetime.date.today()} {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 1e6:.0f} MB; "
          f"torch {torch.__version__}; copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {flops / 1e12:.0f} TFLOP/s; "
          f"torch._grouped_mm {'present' if hasattr(torch, '_grouped_mm') else 'absent'}", flush=True)
    rows: list[dict] = []
    for name in args.models:
        bench_model(name, args.tokens, args.reps, args.copies, props.L2_cache_size, bw, flops, rows, paths)
        torch.cuda.empty_cache()
    print("\n" + markdown(rows, bw, flops, paths))
    if args.json:
        args.json.write_text(json.dumps({"device": props.name, "copy_bytes_per_s": bw, "bf16_flops": flops, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
