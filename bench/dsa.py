"""DeepSeek Sparse Attention decode on one GPU at DeepSeek-V3.2's shapes (128 heads; latent 512 + rope 64;
indexer 64 heads of 128, top-k 2048): our sparse path (paged_index_topk + paged_sparse_mla_attention),
our dense path (paged_mla_attention) and torch SDPA (its fastest backend) on the equivalent dense
problem, in one run, against the roofline.

    python bench/dsa.py                       # batch 1 and 16 x context 2K .. 128K, bf16 caches
    python bench/dsa.py --quick --fp8         # fewer repetitions; FP8 latent and index-key caches
    python bench/dsa.py --prefill 2048        # also 2048 query rows at the end of each context
    python bench/dsa.py --splits 4 8 16 32    # also sparse attention at these key splits per row

Per case: the indexer + top-k alone ("index"), sparse attention alone ("sparse attn"), both ("sparse"),
dense MLA decode ("dense"), SDPA on contiguous [B, 1, ctx, 576] keys / 512-dim values in the absorbed
(MQA) form ("sdpa"), each a CUDA graph replay (GPU time), median of --reps. Roofline: bytes / the copy
bandwidth measured here (bench/moe.py): index keys read (128 bf16 or 128 FP8 + a float32 scale per token),
selected latent entries (min(k, ctx) x 576 values), dense: every entry. "index % copy" is the indexer's
index-key bytes over its time against the copy bandwidth (issue 28's target: 70%); "dense / sparse" is
the per-token speed-up (target: 5x at 128K) and the crossover the smallest context where it exceeds 1
(target: below 8K). "proj" is the absorbed form's two per-head products (q_nope @ w_uk before the kernel,
o_lat @ w_uv^T after it), weight reads that do not depend on the context and that both paths pay; "core"
ratios leave them out (dense - proj over sparse - proj).

Prefill (--prefill T): T query rows ending each context, the indexer (chunked [rows, keys] scores and
top-k) and sparse attention (FLOPs: T x 128 heads x min(k, ctx) keys x (576 + 512) x 2, against the
bf16 matmul rate measured here; target 40%) beside dense MLA prefill of the same rows.
The selections are checked against the reference on the first case."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention_mla import BLOCK, C, DN, DR, DV, pool  # noqa: E402
from bench.moe import copy_bandwidth, graph_replay_us, matmul_rate  # noqa: E402
from dayzero.formats.fp8 import quantize_activation_groups  # noqa: E402
from dayzero.ops.attention_mla import paged_mla_attention, paged_sparse_mla_attention  # noqa: E402
from dayzero.ops.dsa import paged_index_topk  # noqa: E402
from dayzero.ops.paged import FP8_GROUP, PagedStream, SeqBatch  # noqa: E402
from dayzero.ops.registry import REGISTRY  # noqa: E402

HEADS, INDEX_HEADS, INDEX_DIM, TOPK = 128, 64, 128, 2048
CONTEXTS = [2048, 4096, 8192, 32768, 131072]


def index_stream(seq_lens: list[int], table: torch.Tensor, fp8: bool, gen) -> PagedStream:
    """Index keys [pages, BLOCK, 128] paged by the latent's table (one cache group)."""
    pages = int(table.max()) + 1
    keys = torch.randn(pages, BLOCK, INDEX_DIM, generator=gen, device=gen.device, dtype=torch.bfloat16)
    if not fp8:
        return PagedStream(keys, table, BLOCK)
    q, s = quantize_activation_groups(keys.float(), FP8_GROUP)
    return PagedStream(q, table, BLOCK, 1, s, torch.bfloat16)


def case(batch: int, ctx: int, fp8: bool, gen):
    seq_lens = [ctx] * batch
    seqs = SeqBatch.build([1] * batch, seq_lens, gen.device)
    latent, pe = pool(seq_lens, fp8, gen)
    index_k = index_stream(seq_lens, latent.block_table, fp8, gen)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.bfloat16)  # noqa: E731
    w_uk, w_uv = (rand(HEADS, DN + DV, C) / C ** 0.5).split([DN, DV], dim=1)
    q_nope, q_pe = rand(batch, HEADS, DN), rand(batch, HEADS, DR)
    iq, iw = rand(batch, INDEX_HEADS, INDEX_DIM), rand(batch, INDEX_HEADS).float() * INDEX_HEADS ** -0.5
    return dict(mla=(q_nope, q_pe, latent, pe, w_uk, w_uv, (DN + DR) ** -0.5, seqs),
                index=(iq, iw, index_k, INDEX_DIM ** -0.5, TOPK, seqs))


def proj_us(c: dict, reps: int) -> float:
    """The absorbed form's two bmms of paged_mla_attention at these shapes (_mla_decode._attend)."""
    q_nope, w_uk, w_uv = c["mla"][0], c["mla"][4], c["mla"][5]
    o_lat = torch.empty(HEADS, q_nope.shape[0], C, dtype=q_nope.dtype, device=q_nope.device)

    def run(i):
        torch.bmm(q_nope.transpose(0, 1), w_uk)
        return torch.bmm(o_lat, w_uv.transpose(1, 2)).transpose(0, 1)
    return graph_replay_us(run, 1, reps)


def prefill(rows: int, ctx: int, fp8: bool, reps: int, rate: float, gen) -> str:
    """One sequence of ctx tokens whose last `rows` are this step's queries: a markdown row."""
    seqs = SeqBatch.build([rows], [ctx], gen.device)
    latent, pe = pool([ctx], fp8, gen)
    index_k = index_stream([ctx], latent.block_table, fp8, gen)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.bfloat16)  # noqa: E731
    w_uk, w_uv = (rand(HEADS, DN + DV, C) / C ** 0.5).split([DN, DV], dim=1)
    mla = (rand(rows, HEADS, DN), rand(rows, HEADS, DR), latent, pe, w_uk, w_uv, (DN + DR) ** -0.5, seqs)
    index = (rand(rows, INDEX_HEADS, INDEX_DIM), rand(rows, INDEX_HEADS).float() * INDEX_HEADS ** -0.5, index_k,
             INDEX_DIM ** -0.5, TOPK, seqs)
    sel = paged_index_topk(*index)
    index_t = graph_replay_us(lambda i: paged_index_topk(*index), 1, reps)
    attn = graph_replay_us(lambda i: paged_sparse_mla_attention(*mla, sel), 1, reps)
    dense = graph_replay_us(lambda i: paged_mla_attention(*mla), 1, reps)
    flop = rows * HEADS * min(TOPK, ctx) * (C + DR + C) * 2
    return (f"| {rows} x {ctx // 1024}K | {index_t / 1e3:.2f} | {attn / 1e3:.2f} | {(index_t + attn) / 1e3:.2f} | "
            f"{dense / 1e3:.2f} | {100 * flop / (attn * 1e-6) / rate:.0f}% | {dense / (index_t + attn):.2f}x |")


def sdpa_us(batch: int, ctx: int, reps: int, gen) -> float | None:
    q = torch.randn(batch, HEADS, 1, C + DR, generator=gen, device=gen.device, dtype=torch.bfloat16)
    k = torch.randn(batch, 1, ctx, C + DR, generator=gen, device=gen.device, dtype=torch.bfloat16)
    v = k[..., :C]
    fn = torch.nn.functional.scaled_dot_product_attention
    try:
        return graph_replay_us(lambda i: fn(q, k, v, enable_gqa=True), 1, reps)
    except RuntimeError as e:  # no backend takes 576-dim keys with 512-dim values here
        print(f"  SDPA: {str(e).splitlines()[0]}", flush=True)
        return None


def sparse_at(c: dict, sel: torch.Tensor, splits: int) -> torch.Tensor:
    from dayzero.kernels.attention._mla_decode import mla_sparse

    q_nope, w_uv = c["mla"][0], c["mla"][5]
    out = q_nope.new_empty((q_nope.shape[0], HEADS, w_uv.shape[1]))
    mla_sparse(*c["mla"], sel, out, splits=splits)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="FP8 latent and index-key caches")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--prefill", type=int, default=0, metavar="T", help="also T query rows per context (prefill)")
    ap.add_argument("--splits", type=int, nargs="*", default=[], help="also sparse attention at these splits")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 20)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    entry = (C + DR) + (C // FP8_GROUP + 1) * 4 if args.fp8 else (C + DR) * 2
    index_entry = INDEX_DIM + 4 if args.fp8 else INDEX_DIM * 2
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; {'FP8' if args.fp8 else 'bf16'} caches",
          flush=True)
    head = ("| batch x context | index µs | index % copy | sparse attn µs | sparse µs | dense µs "
            "| SDPA µs | proj µs | dense / sparse | core ratio | sparse % roofline |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    checked = False
    for batch in args.batch:
        for ctx in args.contexts:
            c = case(batch, ctx, args.fp8, gen)
            with REGISTRY.record_calls(by_backend=True) as calls:
                sel = paged_index_topk(*c["index"])
                paged_sparse_mla_attention(*c["mla"], sel)
            if not checked:  # the selection's count and bounds against the reference's, once
                with REGISTRY.force_backend("reference"):
                    want = paged_index_topk(*c["index"])
                assert torch.equal((sel >= 0).sum(1), (want >= 0).sum(1)), "selection sizes differ"
                checked = True
            index = graph_replay_us(lambda i: paged_index_topk(*c["index"]), 1, reps)
            attn = graph_replay_us(lambda i: paged_sparse_mla_attention(*c["mla"], sel), 1, reps)
            both = graph_replay_us(lambda i: paged_sparse_mla_attention(*c["mla"], paged_index_topk(*c["index"])), 1, reps)
            dense = graph_replay_us(lambda i: paged_mla_attention(*c["mla"]), 1, reps)
            sdpa = sdpa_us(batch, ctx, reps, gen)
            proj = proj_us(c, reps)
            if args.splits:
                print(f"  {batch} x {ctx // 1024}K sparse attn by splits: " + ", ".join(
                    f"{n}: {graph_replay_us(lambda i: sparse_at(c, sel, n), 1, reps):.1f}" for n in args.splits),
                    flush=True)
            index_bytes = batch * ctx * index_entry
            roof = 1e6 * (index_bytes + batch * min(TOPK, ctx) * entry) / bw
            rows.append(f"| {batch} x {ctx // 1024}K | {index:.1f} | {100 * index_bytes / (index * 1e-6) / bw:.0f}% | "
                        f"{attn:.1f} | {both:.1f} | {dense:.1f} | {'-' if sdpa is None else f'{sdpa:.1f}'} | "
                        f"{proj:.1f} | {dense / both:.2f}x | {(dense - proj) / max(both - proj, 1e-3):.2f}x | "
                        f"{100 * roof / both:.0f}% |")
            print(rows[-1], f"  backends: {', '.join(sorted(calls))}", flush=True)
            del c
            torch.cuda.empty_cache()
    print("\n" + "\n".join(rows))
    if args.prefill:
        rate = matmul_rate()
        print(f"\nprefill, bf16 matmul {rate / 1e12:.0f} TFLOP/s\n"
              "| rows x context | index ms | sparse attn ms | sparse ms | dense ms | sparse attn % matmul | dense / sparse |\n"
              "|---|---|---|---|---|---|---|", flush=True)
        for ctx in args.contexts:
            if ctx >= args.prefill:
                print(prefill(args.prefill, ctx, args.fp8, reps, rate, gen), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
