"""The routed-expert (MoE) layer on the GPU, in one run: ours (the registry op as the engine calls it, and
any kernel variant pinned), a bf16 torch._grouped_mm layer (the baseline), and the roofline (the larger of
the active experts' MXFP4 bytes at the measured copy bandwidth and the FLOPs at the measured bf16 matmul
rate).

    python bench/moe.py --quick                   # 1 8 32 128 8192 tokens, gpt-oss-20b and DeepSeek-V4 shapes
    python bench/moe.py --trees OLD NEW           # the quick table of two checkouts, alternating, one table
                                                  # (--rounds 1 --no-baseline: about half the time)
    python bench/moe.py --models gpt-oss-120b deepseek-v4 --tokens 1 8 32 128 512 2048 8192 \
        --kernels decode gemm mma wgmma fp8 --layers-per-graph 8
    python bench/moe.py --models gpt-oss-120b --tokens 1 \
        --plan 'decode=DecodeConfig(1, 32, 32, 512, 1024, 8, 8, 3, 0, True)'

Method (see /work/shared/research/moe_anchor.md): uniform random top-k routing (distinct experts per token),
random E8M0 scales and codes (never zeros); each timed call uses the next of --copies weight copies whose
total exceeds the L2, so the weights come from HBM; CUDA events, median of --reps. "eager" = the op called
as the engine calls it (at decode sizes it replays its layer graph, kernels/moe/_graphs.py); "graph" = one
CUDA-graph replay of the whole layer (dispatch, both GEMMs, combine). Error: relative Frobenius error
against the exact MXFP4 layer in float32.

--kernels K...: also each named variant (kernels/moe/choose.py, `dayzero ops`) with the tiles choose()
gives it, pinned through an explicit plan; --plan KERNEL=CONFIG: a variant with explicit tiles (CONFIG a
kernels/moe/configs.py expression; gemm, mma and fp8 take a (gate/up, down) pair). All pinned variants of
a call are timed in turn, in a shuffled order, in the same thermal state. fp8 (path B) is timed eagerly
(it synchronises with the host): warm, with every expert of the layer in its workspace, and cold, after
emptying it. --layers-per-graph N: up to 128 tokens also N layers in one graph (how an engine's decode
graph runs them) and the read floor: a kernel that only reads the layer's bytes, one and N per graph.

The quick table and --trees use only what every checkout has (the registry op, ExpertWeights,
Activation, the reference layer, mxfp4.dequantize), so they run against older trees too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import random
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

from dayzero.formats import mxfp4  # noqa: E402
from dayzero.ops.moe import Activation, ExpertWeights, _experts_reference  # noqa: E402

MODELS = {  # experts, top_k, hidden, intermediate, activation, biases
    "gpt-oss-20b": (32, 4, 2880, 2880, Activation("swiglu_clamped", alpha=1.702, limit=7.0), True),
    "gpt-oss-120b": (128, 4, 2880, 2880, Activation("swiglu_clamped", alpha=1.702, limit=7.0), True),
    "deepseek-v4": (256, 6, 4096, 2048, Activation("swiglu", limit=10.0), False),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
QUICK_MODELS = ("gpt-oss-20b", "deepseek-v4")
QUICK_TOKENS = (1, 8, 32, 128, 8192)
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


def interleaved_us(fns: dict, copies: int, reps: int, per_graph: int = 1) -> dict:
    """graph_replay_us of every fn in fns (label -> fn(copy)), timed replay by replay in turn, in an order
    shuffled every pass (fixed seed), so that all see the same thermal and power state (a compute-bound
    layer's time drifts by up to 10% as the card heats; in a fixed order a variant timed after a hot one
    ran up to 14% slower): {label: median µs per call}. The first pass is warm-up."""
    graphs = {label: capture_graphs(fn, copies, per_graph) for label, fn in fns.items()}
    times = {label: [] for label in fns}
    order = list(graphs)
    shuffle = random.Random(0).shuffle
    for rep in range(reps + 1):
        shuffle(order)
        for label in order:
            for g in graphs[label]:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                if rep:
                    times[label].append(1e3 * start.elapsed_time(end) / per_graph)
    del graphs
    return {label: statistics.median(t) for label, t in times.items()}


def layer_inputs(T: int, E: int, k: int, H: int, gen):
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    w = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
    return x, ids, w


# -- pinned variants (this tree only) ----------------------------------------------------------------

def parse_plans(texts: list[str]) -> list[tuple[str, str, object]]:
    """--plan KERNEL=CONFIG -> [(label, kernel, config)], CONFIG evaluated over kernels/moe/configs.py."""
    from dayzero.kernels.moe import configs

    names = {n: getattr(configs, n) for n in ("DecodeConfig", "GemmConfig", "MmaConfig", "WgmmaConfig")}
    plans = []
    for text in texts:
        kernel, sep, expr = text.partition("=")
        if not sep:
            raise SystemExit(f"--plan {text!r}: expected KERNEL=CONFIG, e.g. 'wgmma=WgmmaConfig(128)'")
        plans.append((text, kernel.strip(), eval(expr, {"__builtins__": {}}, names)))  # noqa: S307 (a bench flag)
    return plans


def pinned_plans(x, ids, experts, kernels, explicit) -> dict:
    """{label: Plan}: each variant in `kernels` with the tiles choose() gives it for this call, then the
    explicit --plan ones; no layer graphs (the timing captures the layer itself)."""
    from dayzero import settings
    from dayzero.kernels.moe import Plan, plan_for

    plans = {}
    for kernel in kernels:
        with settings.override(variants={"moe_experts_mxfp4": kernel}):
            try:
                plans[kernel] = dataclasses.replace(plan_for(x, ids, experts), graph_tokens=0)
            except ValueError as e:  # e.g. decode_sm90 beyond one token, a Gluon kernel off sm_90
                print(f"    {kernel}: not run here ({e})", flush=True)
    for label, kernel, config in explicit:
        plans[label] = Plan(kernel, config)
    return plans


def bench_pinned(row, sets, x, ids, w, act, ref, plans, copies, reps, per_graph, bw, flops, mx_bytes, fl):
    """Time the pinned plans (module docstring) and add them to `row` as row["pinned"][label]."""
    from dayzero.kernels.moe import Fp8Workspace, expert_slot_bytes, moe_experts_mxfp4

    E, I, H = sets[0].num_experts, sets[0].w13.shape[1] // 2, x.shape[1]
    out = row["pinned"] = {}
    graphed = {label: p for label, p in plans.items() if p.kernel != "fp8"}
    for label, plan in graphed.items():
        out[label] = {"kernel": plan.kernel, "config": repr(plan.config),
                      "err": rel_err(moe_experts_mxfp4(x, ids, w, sets[0], act, plan), ref)}
    fns = {label: (lambda s, p=plan: moe_experts_mxfp4(x, ids, w, sets[s], act, p)) for label, plan in graphed.items()}
    for label, us in interleaved_us(fns, copies, reps).items():
        out[label]["graph_us"] = us
        if per_graph > 1 and x.shape[0] <= MULTI_LAYER_MAX_TOKENS:
            out[label]["graphn_us"] = interleaved_us({label: fns[label]}, copies, reps, per_graph)[label]
    for label, plan in plans.items():
        if plan.kernel != "fp8":
            continue
        ws = Fp8Workspace(copies * E * expert_slot_bytes(I, H), "cuda", prefetch=False)
        with_ws = [dataclasses.replace(e, workspace=ws) for e in sets]
        warm = lambda s, p=plan: moe_experts_mxfp4(x, ids, w, with_ws[s], act, p)  # noqa: E731

        def cold(s, p=plan):
            ws.clear()
            return moe_experts_mxfp4(x, ids, w, with_ws[s], act, p)

        entry = out[label] = {"kernel": "fp8", "config": repr(plan.config), "err": rel_err(cold(0), ref)}
        entry["cold_us"] = 1e3 * median_ms(cold, reps, copies)
        entry["warm_us"] = 1e3 * median_ms(warm, reps, copies)
        entry["out_of_window"] = ws.stats.out_of_window_blocks
    for entry in out.values():
        t = entry.get("graph_us", entry.get("warm_us"))
        entry["bw_pct"] = 100 * mx_bytes / (t * 1e-6) / bw
        entry["flops_pct"] = 100 * fl / (t * 1e-6) / flops


def bench_model(name, tokens_list, reps, copies, bw, flops, kernels, explicit, per_graph, baseline) -> list[dict]:
    """The rows of one model: the production op, the baseline, the roofline, and the pinned variants."""
    from dayzero import ops

    E, k, H, I, act, bias = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = 3 * H * I
    base = random_experts(E, H, I, bias, gen)
    sets = mxfp4_copies(base, copies)
    bf_sets = []
    if baseline:
        bf = to_bf16(base)
        bf_sets = [bf] + [ExpertWeights("bf16", bf.w13.clone(), bf.w2.clone(), b13=bf.b13, b2=bf.b2)
                          for _ in range(copies - 1)]
    rows = []
    for T in tokens_list:
        x, ids, w = layer_inputs(T, E, k, H, gen)
        distinct = int(torch.unique(ids).numel())
        mx_bytes, fl = distinct * params * 17 / 32, 2 * T * k * params
        ref = _experts_reference(x.float(), ids, w, base, act)
        ours = lambda s: ops.moe_experts_mxfp4(x, ids, w, sets[s], act)  # noqa: E731
        row = {"model": name, "tokens": T, "experts": distinct, "kernel": chosen_kernel(x, ids, base, act),
               "err": rel_err(ours(0), ref), "roofline_us": 1e6 * max(mx_bytes / bw, fl / flops)}
        for s in range(2 * copies):  # compiles, and lets eager decode calls capture their layer graphs
            ours(s % copies)
        row["eager_us"] = 1e3 * median_ms(ours, reps, copies)
        row["graph_us"] = graph_replay_us(ours, copies, reps)
        if baseline:
            base_fn = lambda s: grouped_mm_layer(x, ids, w, bf_sets[s], act)  # noqa: E731
            row["err_baseline"] = rel_err(base_fn(0), ref)
            row["baseline_us"] = graph_replay_us(base_fn, copies, reps)
        if per_graph > 1 and T <= MULTI_LAYER_MAX_TOKENS:
            row["graphn_us"] = graph_replay_us(ours, copies, reps, per_graph)
            row["floor_us"] = read_floor_us(int(mx_bytes), reps, copies)
            row["floorn_us"] = read_floor_us(int(mx_bytes), reps, copies, per_graph)
        if kernels or explicit:
            bench_pinned(row, sets, x, ids, w, act, ref, pinned_plans(x, ids, base, kernels, explicit), copies, reps,
                         per_graph, bw, flops, mx_bytes, fl)
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    line = (f"{r['model']:>12} T={r['tokens']:>5} {r['kernel']:>11}: eager {r['eager_us']:9.1f} graph "
            f"{r['graph_us']:9.1f} us")
    if "baseline_us" in r:
        line += f", grouped_mm {r['baseline_us']:9.1f}"
    line += f", roofline {r['roofline_us']:8.1f} us, err {r['err']:.1e}"
    if "graphn_us" in r:
        line += f" | per layer in a multi-layer graph {r['graphn_us']:.1f}, read floor {r['floorn_us']:.1f} us"
    for label, p in r.get("pinned", {}).items():
        t = f"graph {p['graph_us']:.1f}" if "graph_us" in p else f"warm {p['warm_us']:.1f} cold {p['cold_us']:.1f}"
        line += f"\n    {label}: {t} us, {p['bw_pct']:.0f}% copy BW, {p['flops_pct']:.0f}% bf16, err {p['err']:.1e}"
    return line


def markdown(info: dict, per_graph: int) -> str:
    """The table of the run: one row per model and token count, then the pinned variants."""
    rows = info["rows"]
    base = any("baseline_us" in r for r in rows)
    multi = any("graphn_us" in r for r in rows)
    head = ["model", "T", "experts", "kernel", "ours eager µs", "ours graph µs"]
    head += ["grouped_mm bf16 graph µs"] if base else []
    head += [f"ours µs/layer ({per_graph} per graph)", f"read floor µs ({per_graph} per graph)"] if multi else []
    head += ["roofline µs", "roofline / ours (graph)", "ours rel err"]
    lines = [f"{info['date']} {info['device']}, torch {info['torch']}, Triton {info['triton']}; copy "
             f"{info['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), bf16 matmul {info['bf16_flops'] / 1e12:.0f} "
             f"TFLOP/s", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    nan = float("nan")
    for r in rows:
        cells = [r["model"], str(r["tokens"]), str(r["experts"]), r["kernel"], f"{r['eager_us']:.1f}",
                 f"{r['graph_us']:.1f}"]
        cells += [f"{r.get('baseline_us', nan):.1f}"] if base else []
        cells += [f"{r.get('graphn_us', nan):.1f}", f"{r.get('floorn_us', nan):.1f}"] if multi else []
        cells += [f"{r['roofline_us']:.1f}", f"{r['roofline_us'] / r['graph_us']:.0%}", f"{r['err']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    pinned = [(r, label, p) for r in rows for label, p in r.get("pinned", {}).items()]
    if pinned:
        head = ["model", "T", "pinned", "graph µs (fp8: warm / cold eager)", "% copy BW", "% bf16 rate", "rel err",
                "config"]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r, label, p in pinned:
            t = f"{p['graph_us']:.1f}" if "graph_us" in p else f"{p['warm_us']:.1f} / {p['cold_us']:.1f}"
            lines.append(f"| {r['model']} | {r['tokens']} | {label} | {t} | {p['bw_pct']:.0f}% | {p['flops_pct']:.0f}% "
                         f"| {p['err']:.1e} | `{p['config']}` |")
    return "\n".join(lines)


# -- the quick table, and one tree against another ------------------------------------------------
# (what runs here with --quick must use only what every tree has: see the module docstring)

def chosen_kernel(x, ids, experts, act) -> str:
    """The kernel variant this tree's chooser picks for the call ('-' where the tree has no chooser)."""
    try:
        from dayzero.kernels.moe import plan_for
    except ImportError:
        return "-"
    return plan_for(x, ids, experts).kernel


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
    ap.add_argument("--quick", action="store_true",
                    help=f"the production op only, at {' '.join(map(str, QUICK_TOKENS))} tokens on "
                         f"{' and '.join(QUICK_MODELS)} shapes (unless --models / --tokens say otherwise)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int)
    ap.add_argument("--kernels", nargs="+", default=[], help="also these variants of moe_experts_mxfp4, pinned")
    ap.add_argument("--plan", action="append", default=[], help="also this KERNEL=CONFIG, pinned (repeatable)")
    ap.add_argument("--layers-per-graph", type=int, default=1,
                    help=f"up to {MULTI_LAYER_MAX_TOKENS} tokens: also this many layers in one graph, and the read floor")
    ap.add_argument("--no-baseline", action="store_true", help="skip the grouped_mm layer (and its bf16 weights)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copies", type=int, default=3, help="weight copies rotated per call (total must exceed L2)")
    ap.add_argument("--json", type=Path, help="write the raw rows here")
    ap.add_argument("--tree", type=Path, help="import dayzero from this checkout (default: this script's)")
    ap.add_argument("--trees", nargs="+", type=Path,
                    help="compare the quick tables of these checkouts (one process each, alternating)")
    ap.add_argument("--rounds", type=int, default=2, help="with --trees: rounds over the trees")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe.py needs a CUDA device")
    if args.trees:
        extra = ["--reps", str(args.reps), "--copies", str(args.copies)] + (["--no-baseline"] if args.no_baseline else [])
        extra += ["--models", *args.models] if args.models else []
        extra += ["--tokens", *map(str, args.tokens)] if args.tokens else []
        compare_trees(args.trees, args.rounds, extra)
        return
    if args.quick and (args.kernels or args.plan or args.layers_per_graph > 1):
        sys.exit("--quick times the production op (and the baseline) only: no --kernels, --plan, --layers-per-graph")
    models = args.models or list(QUICK_MODELS if args.quick else MODELS)
    tokens = args.tokens or list(QUICK_TOKENS if args.quick else TOKENS)
    props = torch.cuda.get_device_properties(0)
    bw, flops = copy_bandwidth(), matmul_rate()
    info = {"device": props.name, "date": str(datetime.date.today()), "torch": torch.__version__,
            "triton": triton.__version__, "copy_bytes_per_s": bw, "bf16_flops": flops, "rows": []}
    print(f"{info['date']} {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 1e6:.0f} MB; "
          f"copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    explicit = parse_plans(args.plan) if args.plan else []
    for name in models:
        info["rows"] += bench_model(name, tokens, args.reps, args.copies, bw, flops, args.kernels, explicit,
                                    args.layers_per_graph, not args.no_baseline)
        torch.cuda.empty_cache()
    print("\n" + markdown(info, args.layers_per_graph))
    if args.json:
        args.json.write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
