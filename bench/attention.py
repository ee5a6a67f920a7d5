"""paged_gqa_attention on one GPU: the Triton kernels (dayzero/kernels/attention) vs the reference op and
torch's SDPA on contiguous tensors, against the roofline, gpt-oss-20b's attention shapes (64 query / 8 kv
heads, dim 64, bf16, sinks, pages of 16 tokens, keys and values in one arena as the cache holds them).

    python bench/attention.py            # decode at batch 1 / 64 x 1K / 8K / 32K keys, prefill of 4K / 16K / 64 x 128
                                         # (prefills: the Triton kernel and torch's FA2 both timed)
    python bench/attention.py --quick    # fewer repetitions, no reference timing past 8K
    python bench/attention.py --sweep    # also time tile / split variants around what `choose` picks
    python bench/attention.py --json out.json

Roofline, measured in the same run: decode = KV bytes read (keys and values of every sequence, FP8
scales included) / the device-to-device copy bandwidth (bench.moe.copy_bandwidth, read + write bytes
per second); prefill = FLOP (4 x heads x dim per visible query-key pair, causal) / the bf16 matmul rate
(bench.moe.matmul_rate, 8192^3). Ours is timed as CUDA graph replays (GPU time, the eager launch cost
beside it), the others eagerly; each a median of --reps (torch.cuda events). Small pools rotate over
copies so that the timed reads do not come from L2. SDPA has no sinks and reads contiguous keys: it is
the speed of torch's own kernels on the same arithmetic, not the same op."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import copy_bandwidth, graph_replay_us, matmul_rate, median_ms  # noqa: E402
from dayzero.formats.fp8 import quantize_activation_groups  # noqa: E402
from dayzero.kernels.attention.gqa import paged_gqa_attention, plan_for  # noqa: E402
from dayzero.kernels.attention.gqa_choose import DecodeConfig, Plan, PrefillConfig  # noqa: E402
from dayzero.ops.attention_gqa import paged_gqa_attention as paged_op  # noqa: E402
from dayzero.ops.paged import FP8_GROUP, PagedStream, SeqBatch  # noqa: E402
from dayzero.ops.registry import REGISTRY  # noqa: E402

HQ, HKV, DIM, PAGE = 64, 8, 64, 16
L2_BYTES = 60 << 20  # H200: 50 MiB L2; pools are rotated until they exceed a few times this
DECODE = [(1, 1024), (1, 8192), (1, 32768), (64, 1024), (64, 8192), (64, 32768)]
PREFILL = [4096, 16384]


@dataclass
class Case:
    label: str
    q: torch.Tensor
    pools: list  # [(k, v)] copies of the cache, rotated between timed calls
    seqs: SeqBatch
    sinks: torch.Tensor
    window: int | None
    kv_bytes: int
    flop: int


def make_pool(num_seqs: int, seq_len: int, fp8: bool, gen: torch.Generator) -> tuple[PagedStream, PagedStream]:
    """Keys and values of num_seqs sequences of seq_len tokens in shuffled pages of one arena
    [pages, 2 (k, v), PAGE, HKV, DIM] (so stride(0) of each stream is the arena's page size)."""
    per_seq = -(-seq_len // PAGE)
    pages = num_seqs * per_seq
    arena = torch.randn(pages, 2, PAGE, HKV, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    scales = None
    if fp8:
        arena, scales = quantize_activation_groups(arena, FP8_GROUP)
    table = torch.randperm(pages, device="cuda", generator=gen).view(num_seqs, per_seq).to(torch.int32)
    dtype = torch.bfloat16 if fp8 else None
    return tuple(PagedStream(arena[:, i], table, PAGE, 1, None if scales is None else scales[:, i], dtype)
                 for i in range(2))


def kv_bytes(keys_read: int, fp8: bool) -> int:
    per_token = 2 * HKV * DIM * (1 if fp8 else 2) + (2 * HKV * 4 if fp8 else 0)
    return keys_read * per_token


def decode_case(batch: int, ctx: int, fp8: bool, window: int | None, gen) -> Case:
    keys = batch * (min(ctx, window) if window else ctx)
    nbytes = kv_bytes(keys, fp8)
    copies = max(1, min(64, -(-4 * L2_BYTES // nbytes)))
    pools = [make_pool(batch, ctx, fp8, gen) for _ in range(copies)]
    q = torch.randn(batch, HQ, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    label = f"decode B={batch} ctx={ctx // 1024}K" + (" fp8" if fp8 else "") + (f" W={window}" if window else "")
    return Case(label, q, pools, SeqBatch.build([1] * batch, [ctx] * batch, "cuda"), _sinks(gen), window, nbytes,
                4 * HQ * DIM * keys)


def prefill_case(tokens: int, window: int | None, gen, num_seqs: int = 1) -> Case:
    pairs = num_seqs * sum(min(p + 1, window) if window else p + 1 for p in range(tokens))
    q = torch.randn(num_seqs * tokens, HQ, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    size = f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)
    label = f"prefill {num_seqs} x {size}" if num_seqs > 1 else f"prefill {size}" + (f" W={window}" if window else "")
    seqs = SeqBatch.build([tokens] * num_seqs, [tokens] * num_seqs, "cuda")
    return Case(label, q, [make_pool(num_seqs, tokens, False, gen)], seqs, _sinks(gen), window,
                kv_bytes(num_seqs * tokens, False), 4 * HQ * DIM * pairs)


def _sinks(gen) -> torch.Tensor:
    return torch.randn(HQ, device="cuda", generator=gen)


def run_ours(c: Case, reps: int, plan: Plan | None = None) -> tuple[float, float]:
    """(graph µs, eager µs) of the kernels on case c."""
    def call(s):
        k, v = c.pools[s % len(c.pools)]
        return paged_gqa_attention(c.q, k, v, c.seqs, DIM ** -0.5, c.window, c.sinks, plan=plan)

    n = len(c.pools)
    return graph_replay_us(call, n, reps), 1e3 * median_ms(call, reps, n)


def run_reference(c: Case, reps: int) -> float:
    k, v = c.pools[0]
    with REGISTRY.force_backend("reference"):
        return 1e3 * median_ms(lambda s: paged_op(c.q, k, v, c.seqs, DIM ** -0.5, c.window, c.sinks), reps, 1)


def run_sdpa(c: Case, reps: int) -> float | None:
    """torch SDPA on contiguous [B, H, S, D] tensors of the same sizes (causal for a prefill, no sinks)."""
    if c.window is not None:
        return None
    b, s = c.seqs.num_seqs, c.seqs.max_seq_len
    t = c.seqs.max_query_len
    q = c.q.view(b, t, HQ, DIM).transpose(1, 2)
    k = torch.randn(b, HKV, s, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn = torch.nn.functional.scaled_dot_product_attention
    try:
        return 1e3 * median_ms(lambda i: fn(q, k, v, is_causal=t > 1, enable_gqa=True), reps, 1)
    except RuntimeError as e:  # no kernel for these arguments on this torch
        print(f"  SDPA failed: {e}", flush=True)
        return None


def check(c: Case) -> float:
    """Max |ours - reference| on the case's first pool."""
    k, v = c.pools[0]
    got = paged_gqa_attention(c.q, k, v, c.seqs, DIM ** -0.5, c.window, c.sinks)
    with REGISTRY.force_backend("reference"):
        want = paged_op(c.q, k, v, c.seqs, DIM ** -0.5, c.window, c.sinks)
    return float((got.float() - want.float()).abs().max())


def sweep(c: Case, reps: int) -> list[dict]:
    """Tiles and splits around the chosen plan, each timed as graph replays."""
    chosen = plan_for(c.q, c.pools[0][0], c.seqs, c.window)
    plans = []
    if chosen.decode is not None:
        s = chosen.decode.splits
        for splits in sorted({max(1, s // 2), s, min(64, 2 * s)}):
            for bn, warps, stages in ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3)):
                plans.append(Plan(chosen.decode_seqs, DecodeConfig(splits, bn, warps, stages), None))
    else:
        for bm, bn, warps, stages in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
                                      (128, 32, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4)):
            plans.append(Plan(0, None, PrefillConfig(bm, bn, warps, stages)))
    rows = []
    for plan in plans:
        us, _ = run_ours(c, reps, plan)
        rows.append(dict(case=c.label, plan=str(plan.decode or plan.prefill), us=us))
        print(f"  sweep {c.label}: {plan.decode or plan.prefill}: {us:9.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    reps = args.reps or (10 if args.quick else 50)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    specs = [("decode", b, ctx, False, None) for b, ctx in DECODE]
    specs += [("decode", 64, 8192, True, None), ("decode", 64, 8192, False, 128)]
    specs += [("prefill", t, None) for t in PREFILL] + [("prefill", 16384, 128), ("prefill", 128, None, 64)]
    rows, sweeps = [], []
    for spec in specs:
        c = decode_case(*spec[1:], gen) if spec[0] == "decode" else prefill_case(spec[1], spec[2], gen, *spec[3:])
        err = check(c)
        ours, eager = run_ours(c, reps)
        big = c.seqs.num_tokens * c.seqs.max_seq_len > (1 << 23) if spec[0] == "prefill" else c.kv_bytes > (1 << 30)
        ref = None if (args.quick and big) else run_reference(c, 1 if big else min(reps, 5))
        sdpa = run_sdpa(c, reps)
        if spec[0] == "decode":
            roof, what = 1e6 * c.kv_bytes / bw, f"{c.kv_bytes / 2**20:.0f} MiB"
        else:
            roof, what = 1e6 * c.flop / rate, f"{c.flop / 1e12:.2f} TFLOP"
        row = dict(case=c.label, work=what, ours_us=ours, eager_us=eager, reference_us=ref, sdpa_us=sdpa,
                   roofline_us=roof, pct=100 * roof / ours, err=err)
        if spec[0] == "prefill":  # both prefill backends, pinned (the row above is what `choose` picks)
            chosen = plan_for(c.q, c.pools[0][0], c.seqs, c.window)
            for name, flash in (("triton", False), ("flash", True)):
                row[f"{name}_us"] = run_ours(c, reps, dataclasses.replace(chosen, flash=flash))[0]
            print(f"  {c.label}: chosen {'FA2' if chosen.flash else 'Triton'}; Triton {row['triton_us']:.1f} us, "
                  f"FA2 {row['flash_us']:.1f} us (graph)", flush=True)
        rows.append(row)
        print(format_row(row), flush=True)
        if args.sweep and c.label in ("decode B=64 ctx=8K", "decode B=1 ctx=32K", "prefill 16K"):
            sweeps += sweep(c, reps)
        del c
        torch.cuda.empty_cache()
    print()
    print(table(rows, bw, rate))
    if args.json:
        args.json.write_text(json.dumps(dict(copy_bw=bw, matmul=rate, rows=rows, sweep=sweeps), indent=1))


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def format_row(r: dict) -> str:
    return (f"{r['case']:>26}: ours {_us(r['ours_us'])} us (eager {_us(r['eager_us'])}), reference "
            f"{_us(r['reference_us'])}, SDPA {_us(r['sdpa_us'])}, roofline {_us(r['roofline_us'])} us "
            f"({r['work']}) = {r['pct']:.0f}%, max err {r['err']:.1e}")


def table(rows: list[dict], bw: float, rate: float) -> str:
    head = ("| case | work | ours µs (graph) | ours eager µs | reference µs | torch SDPA µs | roofline µs | "
            "ours % of roofline |\n|---|---|---|---|---|---|---|---|")
    lines = [f"roofline: decode = KV bytes / {bw / 1e12:.2f} TB/s copy; prefill = FLOP / {rate / 1e12:.0f} TFLOP/s",
             head]
    for r in rows:
        lines.append(f"| {r['case']} | {r['work']} | {_us(r['ours_us'])} | {_us(r['eager_us'])} | "
                     f"{_us(r['reference_us'])} | {_us(r['sdpa_us'])} | {_us(r['roofline_us'])} | {r['pct']:.0f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
