"""DeepSeek-V4 decode attention over the paged streams at V4-Flash's shapes (64 heads of 512 on one shared
key=value head, window 128; CSA: ratio 4, the indexer 64 x 128 with top-512; HCA: ratio 128): per layer,
the CSA indexer + top-k (`paged_v4_index_topk`), CSA attention and HCA attention (`paged_v4_attention`),
against the same attention over rows gathered first (`sparse_attention` after PagedStream.gather_rows,
what a decode ran before the paged kernels), in one run.

    python bench/v4.py              # batch 1 and 16 at 8K, 128K and 1M
    python bench/v4.py --quick      # batch 1 and 16 at 8K and 128K
    python bench/v4.py --fp8        # FP8 streams

µs per call from CUDA-graph replays (the gathered form's gather included, outside the graph it cannot
capture: timed eagerly). Roofline: the bytes each call must read (index keys of every visible entry;
window + chosen entries, or window + every HCA entry) against the measured copy bandwidth. The target
(issue 28): decode at 128K and 1M within 2x of 8K."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import copy_bandwidth, graph_replay_us  # noqa: E402
from dayzero.formats.fp8 import quantize_activation_groups  # noqa: E402
from dayzero.ops.attention_v4 import sparse_attention  # noqa: E402
from dayzero.ops.attention_v4_paged import paged_v4_attention, paged_v4_index_topk  # noqa: E402
from dayzero.ops.paged import FP8_GROUP, PagedStream  # noqa: E402
from dayzero.ops.registry import REGISTRY  # noqa: E402

HEADS, DIM, WINDOW, INDEX_HEADS, INDEX_DIM, TOPK, CSA, HCA = 64, 512, 128, 64, 128, 512, 4, 128
BLOCK = 128  # tokens a page (a multiple of both ratios)


def stream(batch: int, ctx: int, rate: int, dim: int, fp8: bool, gen, windowed: bool = False) -> PagedStream:
    """Entries of `batch` sequences of ctx tokens at `rate`, on pages in a shuffled order; windowed: only
    the last two blocks hold pages (the window's; the rest reclaimed, -1), as a sliding-window group."""
    blocks = -(-ctx // BLOCK) + 1
    live = 3 if windowed else blocks
    per_block = max(1, BLOCK // rate)
    pages = torch.randperm(batch * live, device=gen.device, generator=gen).view(batch, live).to(torch.int32)
    table = torch.full((batch, blocks), -1, dtype=torch.int32, device=gen.device)
    table[:, blocks - live:] = pages
    data = torch.randn(batch * live, per_block, dim, device=gen.device, generator=gen, dtype=torch.bfloat16)
    if not fp8:
        return PagedStream(data, table, BLOCK, rate)
    q, s = quantize_activation_groups(data.float(), FP8_GROUP)
    return PagedStream(q, table, BLOCK, rate, s, torch.bfloat16)


def gathered_us(q, window, comp, indices, positions, ratio, sinks, reps: int) -> float:
    """The gathered form: each row's window and compressed entries gathered, then sparse_attention."""
    b = q.shape[0]
    p = positions.tolist()
    lo_w = [max(0, x - WINDOW + 1) for x in p]
    n = [(x + 1) // ratio for x in p]

    def once():
        kv = window.gather_rows(list(range(b)), lo_w, [x + 1 for x in p])
        entries = comp.gather_rows(list(range(b)), [0] * b, n)
        return sparse_attention(q[:, None], kv, sinks, DIM ** -0.5, WINDOW, entries,
                                None if indices is None else indices[:, None], positions[:, None], ratio)
    once()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    contexts = (8192, 131072) if args.quick else (8192, 131072, 1 << 20)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    entry = DIM + 4 * DIM // FP8_GROUP if args.fp8 else 2 * DIM
    ientry = INDEX_DIM + 4 if args.fp8 else 2 * INDEX_DIM
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; {'FP8' if args.fp8 else 'bf16'} streams",
          flush=True)
    sinks = torch.randn(HEADS, device="cuda", generator=gen)
    head = ("| batch x context | CSA index µs | CSA attn µs | HCA attn µs | gathered CSA / HCA µs | layer pair µs "
            "| roofline µs | % roofline |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for batch in (1, 16):
        for ctx in contexts:
            positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
            window = stream(batch, ctx, 1, DIM, args.fp8, gen, windowed=True)
            csa, hca = stream(batch, ctx, CSA, DIM, args.fp8, gen), stream(batch, ctx, HCA, DIM, args.fp8, gen)
            keys = stream(batch, ctx, CSA, INDEX_DIM, args.fp8, gen)
            q = torch.randn(batch, HEADS, DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
            iq = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
            iw = torch.randn(batch, INDEX_HEADS, device="cuda", generator=gen, dtype=torch.bfloat16)
            with REGISTRY.record_calls(by_backend=True) as calls:
                idx = paged_v4_index_topk(iq, keys, iw, positions, CSA, TOPK)
                paged_v4_attention(q, window, sinks, DIM ** -0.5, WINDOW, positions, csa, idx, CSA)
            index = graph_replay_us(lambda i: paged_v4_index_topk(iq, keys, iw, positions, CSA, TOPK), 1, args.reps)
            a_csa = graph_replay_us(lambda i: paged_v4_attention(q, window, sinks, DIM ** -0.5, WINDOW, positions, csa,
                                                                 idx, CSA), 1, args.reps)
            a_hca = graph_replay_us(lambda i: paged_v4_attention(q, window, sinks, DIM ** -0.5, WINDOW, positions, hca,
                                                                 None, HCA), 1, args.reps)
            g_csa = gathered_us(q, window, csa, idx, positions, CSA, sinks, min(args.reps, 10)) if ctx <= 131072 else None
            g_hca = gathered_us(q, window, hca, None, positions, HCA, sinks, min(args.reps, 10)) if ctx <= 131072 else None
            read = batch * ((ctx // CSA) * ientry + (2 * WINDOW + TOPK + ctx // HCA) * entry)
            roof = 1e6 * read / bw
            pair = index + a_csa + a_hca
            gathered = "-" if g_csa is None else f"{g_csa:.1f} / {g_hca:.1f}"
            rows.append(f"| {batch} x {ctx // 1024}K | {index:.1f} | {a_csa:.1f} | {a_hca:.1f} | {gathered} | "
                        f"{pair:.1f} | {roof:.1f} | {100 * roof / pair:.0f}% |")
            print(rows[-1], f"  backends: {', '.join(sorted(calls))}", flush=True)
            del window, csa, hca, keys
            torch.cuda.empty_cache()
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
