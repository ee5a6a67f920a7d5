"""Paged MLA attention (paged_mla_attention) on one GPU at DeepSeek-V3's shapes (Dn 128, Dr 64, C 512,
Dv 128; H 128, or 16 as one GPU of eight holds): the Triton kernels (dayzero/kernels/attention/_mla_*.py)
against the reference op and the roofline, all measured in the same run.

    python bench/attention_mla.py              # H 128 and 16, BF16 and FP8 caches
    python bench/attention_mla.py --quick      # H 128, fewer repetitions
    python bench/attention_mla.py --heads 128 --caches bf16 --splits 1 2 4 8 16 32 64   # tune the decode split

Cases: decode at batch 1 and 64 x context 1K and 8K (one new token per sequence, absorbed form), and one
fresh 4K-token prefill (expanded form). The pool is one arena of 576-value entries per token (latent
then rope key, FlashMLA's layout; FP8: 5 float32 scales beside), pages of 64 tokens in a shuffled order;
each timed call uses the next of several copies of the pool and of kv_b's weight so that their bytes
exceed the L2 (decode at batch 1 reads the 16.8 MB of w_uk / w_uv, as a model's layer does).
Timing: CUDA events, median of --reps; "graph" replays the op captured in a CUDA graph (no host time),
"eager" calls it through the registry. Roofline = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate),
both measured here (bench/moe.py): bytes = cache entries read + weights + queries and outputs; FLOPs =
what the form computed needs (decode: the absorbed products; prefill: the causal expanded attention plus
the up-projection of every key). "KV % copy" = cache bytes / graph time against the copy bandwidth
(the issue's decode target is 60% at batch 64 x 8K). Error: relative Frobenius error against the reference.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import copy_bandwidth, graph_replay_us, matmul_rate, median_ms  # noqa: E402
from dayzero.formats.fp8 import quantize_activation_groups  # noqa: E402
from dayzero.kernels.attention._mla_decode import mla_decode  # noqa: E402
from dayzero.ops.attention_mla import paged_mla_attention  # noqa: E402
from dayzero.ops.paged import FP8_GROUP, PagedStream, SeqBatch  # noqa: E402
from dayzero.ops.registry import REGISTRY  # noqa: E402

DN, DR, C, DV = 128, 64, 512, 128
BLOCK = 64
DECODE = [(1, 1024), (1, 8192), (64, 1024), (64, 8192)]  # (batch, context)
PREFILL = 4096


def call_bytes(heads: int, query_lens: list[int], seq_lens: list[int], fp8: bool) -> tuple[int, int]:
    """(cache bytes, all bytes) one call reads and writes: the entries of every sequence (FP8: values and
    float32 scales), w_uk and w_uv, queries and outputs (bf16)."""
    entry = (C + DR) + (C // FP8_GROUP + 1) * 4 if fp8 else (C + DR) * 2
    kv = sum(seq_lens) * entry
    return kv, kv + heads * (DN + DV) * C * 2 + sum(query_lens) * heads * (DN + DR + DV) * 2


def pool(seq_lens: list[int], fp8: bool, gen: torch.Generator) -> tuple[PagedStream, PagedStream]:
    """(latent stream, rope stream) over one arena [pages, BLOCK, C + DR] on gen's device, pages in a
    shuffled order."""
    device = gen.device
    pages = [math.ceil(s / BLOCK) for s in seq_lens]
    order = torch.randperm(sum(pages), generator=gen, device=device).to("cpu", torch.int32)
    table = torch.full((len(seq_lens), max(pages)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start:start + n]
        start += n
    table = table.to(device)
    arena = torch.randn(sum(pages), BLOCK, C + DR, generator=gen, device=device, dtype=torch.bfloat16)
    if not fp8:
        return PagedStream(arena[..., :C], table, BLOCK), PagedStream(arena[..., C:], table, BLOCK)
    groups = C // FP8_GROUP
    lat, lat_s = quantize_activation_groups(arena[..., :C].float(), FP8_GROUP)
    pe, pe_s = quantize_activation_groups(arena[..., C:].float(), FP8_GROUP)
    data = torch.cat([lat, pe], -1)
    scales = torch.cat([lat_s, pe_s], -1)
    return (PagedStream(data[..., :C], table, BLOCK, 1, scales[..., :groups], torch.bfloat16),
            PagedStream(data[..., C:], table, BLOCK, 1, scales[..., groups:], torch.bfloat16))


def problems(heads: int, query_lens: list[int], seq_lens: list[int], fp8: bool, copies: int, gen):
    """`copies` argument tuples of the op on gen's device: separate pools, weights and queries, one SeqBatch."""
    device = gen.device
    seqs = SeqBatch.build(query_lens, seq_lens, device)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)  # noqa: E731
    out = []
    for _ in range(copies):
        latent, pe = pool(seq_lens, fp8, gen)
        w_uk, w_uv = (rand(heads, DN + DV, C) / C ** 0.5).split([DN, DV], dim=1)
        q_nope, q_pe = rand(seqs.num_tokens, heads, DN), rand(seqs.num_tokens, heads, DR)
        out.append((q_nope, q_pe, latent, pe, w_uk, w_uv, (DN + DR) ** -0.5, seqs))
    return out


def bench_case(name: str, heads: int, query_lens, seq_lens, fp8: bool, flop: float, reps: int, ref_reps: int,
               l2: int, bw: float, rate: float, gen, splits: list[int] = ()) -> dict:
    kv_bytes, nbytes = call_bytes(heads, query_lens, seq_lens, fp8)
    copies = max(1, min(16, math.ceil(3 * l2 / nbytes)))
    args = problems(heads, query_lens, seq_lens, fp8, copies, gen)
    run = lambda i: paged_mla_attention(*args[i])  # noqa: E731
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = run(0)
    with REGISTRY.force_backend("reference"):
        want = run(0)
        ref_ms = median_ms(run, ref_reps, copies) if ref_reps else float("nan")
    eager_us = 1e3 * median_ms(run, reps, copies)
    graph_us = graph_replay_us(run, copies, reps)
    roof_us = 1e6 * max(nbytes / bw, flop / rate)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    outs = [torch.empty_like(got) for _ in args]
    split_us = {n: graph_replay_us(lambda i: mla_decode(*args[i], 0, len(seq_lens), outs[i], splits=n), copies, reps)
                for n in splits}
    return dict(case=name, heads=heads, cache="fp8" if fp8 else "bf16", backend=",".join(calls), eager_us=eager_us,
                graph_us=graph_us, ref_us=1e3 * ref_ms, roof_us=roof_us, bytes_us=1e6 * nbytes / bw,
                flop_us=1e6 * flop / rate, kv_pct=100 * kv_bytes / (graph_us * 1e-6) / bw,
                tflops=flop / (graph_us * 1e-6) / 1e12, err=err, split_us=split_us)


def decode_flop(heads: int, batch: int, ctx: int) -> float:
    return batch * heads * (2 * DN * C + ctx * (2 * (C + DR) + 2 * C) + 2 * C * DV)


def prefill_flop(heads: int, tokens: int) -> float:
    pairs = tokens * (tokens + 1) / 2
    return heads * (pairs * 2 * (DN + DR + DV) + 2 * tokens * C * (DN + DV))


def table(rows: list[dict]) -> str:
    head = ("| case | H | cache | ours graph µs | ours eager µs | reference µs | roofline µs (bytes / FLOPs) | "
            "% roofline | KV % copy | TFLOP/s | error |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['case']} | {r['heads']} | {r['cache']} | {r['graph_us']:.1f} | {r['eager_us']:.1f} | "
                     f"{r['ref_us']:.0f} | {r['roof_us']:.1f} ({r['bytes_us']:.1f} / {r['flop_us']:.1f}) | "
                     f"{100 * r['roof_us'] / r['graph_us']:.0f}% | {r['kv_pct']:.0f}% | {r['tflops']:.0f} | "
                     f"{r['err']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="H 128 only, 5 repetitions, one reference call")
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--caches", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ref-reps", type=int, default=3, help="reference calls timed per case (0: none)")
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="decode: also time the op's decode path with each of these key-split counts (graph)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/attention_mla.py needs a CUDA device")
    heads, reps, ref_reps = (([128], 5, 1) if args.quick else (args.heads, args.reps, args.ref_reps))
    props = torch.cuda.get_device_properties(0)
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"{datetime.date.today()} {props.name}, {props.multi_processor_count} SMs, "
          f"L2 {props.L2_cache_size / 1e6:.0f} MB; torch {torch.__version__}; copy {bw / 1e12:.2f} TB/s "
          f"(read+write), bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for h in heads:
        for fp8 in (c == "fp8" for c in args.caches):
            cases = [(f"decode {b} x {n}", [1] * b, [n] * b, decode_flop(h, b, n), args.splits) for b, n in DECODE]
            cases.append((f"prefill {PREFILL}", [PREFILL], [PREFILL], prefill_flop(h, PREFILL), []))
            for name, query_lens, seq_lens, flop, splits in cases:
                rows.append(bench_case(name, h, query_lens, seq_lens, fp8, flop, reps, ref_reps, props.L2_cache_size,
                                       bw, rate, gen, splits))
                torch.cuda.empty_cache()
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                if splits:
                    print("  splits: " + ", ".join(f"{n}: {us:.1f} µs" for n, us in rows[-1]["split_us"].items()))
    print("\n" + table(rows))
    print("backends: " + ", ".join(sorted({r["backend"] for r in rows})))


if __name__ == "__main__":
    main()
