"""paged_index_topk on CUDA: the lightning indexer's scores of a packed step read from the paged index
keys in place, then the ranked top-k.

Scores: one program per (query row, BLOCK_N keys) of the rows r0 .. r1 - 1: the row's sequence (from
a per-row sequence index) gives its block-table row and its position p; keys past p (and past the
sequence) score -inf and are not read; the others are read through the table (an FP8 stream dequantized
by its scales and rounded to q's dtype, as PagedStream.read), and score sum_h w[h] * relu(scale * q[h] . k) in float32: bf16 / f16 products on the
tensor cores (exact in float32, summed in float32), float32 and FP8 streams as IEEE float32 products.
A chunk of rows writes [rows, S] (S: the longest sequence of the step rounded up to BLOCK_N), chunked so
that it stays within SCORE_BYTES.

Top-k: the reference's order (dayzero.ops.dsa.ranked_topk: descending score, equal scores by ascending
key, -0.0 as 0.0) is made a total order of distinct int64 keys, so that torch.topk (a radix select, much
faster than the reference's stable sort of the whole row) can neither pick nor order ties its own way:
    key = sortable(score) * 2^32 + (2^31 - 1 - position)
sortable maps float32 bits to an int32 in the floats' order (negative floats: the low 31 bits flipped);
keys not visible are INT64_MIN and come back as -1. One torch.topk per chunk of rows (a two-stage top-k
by pieces of the row and a radix select over many programs a row, both for few long rows, measured
slower on the H200: BENCHMARKS.md). Host sizes only (no device value is read)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.attention._paged_tile import load_tile, locate, mma, stream_args
from dayzero.kernels.dsa._topk import best_positions
from dayzero.ops.paged import token_sequences

BLOCK_N = 64
SCORE_BYTES = 1 << 29  # int64 order keys of one chunk of rows


INT64_MIN = tl.constexpr(-2**63)


@triton.jit
def _order_key(score, tokens):
    """int64 keys in ranked_topk's order of (score, token): module docstring."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ranks as 0.0
    bits = score.to(tl.int32, bitcast=True)
    sortable = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (sortable.to(tl.int64) << 32) | (0x7FFFFFFF - tokens).to(tl.int64)


@triton.jit
def _scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, table_ptr, row_seq_ptr, qstart_ptr, seqlen_ptr, out_ptr, scale, r0,
                   stride_qn, stride_qh, stride_wn, stride_t, stride_on, k_sp, k_ss, ks_sp, ks_ss, ks_sg,
                   H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, F32: tl.constexpr):
    i = tl.program_id(0)
    row = r0 + i
    n0 = tl.program_id(1) * BLOCK_N
    tokens = n0 + tl.arange(0, BLOCK_N)
    b = tl.load(row_seq_ptr + row)
    pos = tl.load(seqlen_ptr + b) - (tl.load(qstart_ptr + b + 1) - row)  # the query's position
    ok = tokens <= pos
    dst = out_ptr + i.to(tl.int64) * stride_on + tokens
    if n0 > pos:
        tl.store(dst, tl.full([BLOCK_N], INT64_MIN, tl.int64))
    else:
        offs_d = tl.arange(0, BLOCK_D)
        heads = tl.arange(0, BLOCK_H)
        hmask = heads < H
        page, slot = locate(table_ptr + b.to(tl.int64) * stride_t, tokens, ok, PAGE, True)
        k = load_tile(k_ptr, ks_ptr, page, slot, ok, 0, offs_d, k_sp, k_ss, 0, ks_sp, ks_ss, 0, ks_sg, D, True, FP8)
        k = k.to(q_ptr.dtype.element_ty)  # an FP8 stream reads back in the model's dtype, as the reference's
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=hmask[:, None] & (offs_d < D)[None, :], other=0.0)
        w = tl.load(w_ptr + row.to(tl.int64) * stride_wn + heads, mask=hmask, other=0.0).to(tl.float32)
        if F32:
            s = mma(k.to(tl.float32), tl.trans(q.to(tl.float32)), True)
        else:
            s = mma(k.to(q.dtype), tl.trans(q), False)
        s = tl.maximum(s * scale, 0.0)  # [BLOCK_N keys, BLOCK_H heads]
        score = tl.sum(s * w[None, :], 1)
        tl.store(dst, tl.where(ok, _order_key(score, tokens), INT64_MIN))


def paged_index_topk(q, weights, index_k, scale, k, seqs):
    """As dayzero.ops.dsa.paged_index_topk (checked by `supports`): int32 [N, k] key positions, -1 padded."""
    n, h, d = q.shape
    out = torch.full((n, k), -1, dtype=torch.int32, device=q.device)
    if n == 0:
        return out
    width = triton.cdiv(seqs.max_seq_len, BLOCK_N) * BLOCK_N
    row_seq = token_sequences(seqs)
    data, scales, k_sp, k_ss = stream_args(index_k)[:4]
    ks_sp, ks_ss, ks_sg = (0, 0, 0) if index_k.scales is None else (*index_k.scales.stride(),)
    fp8 = index_k.scales is not None
    chunk = max(1, SCORE_BYTES // (8 * width))
    keys = torch.empty((min(chunk, n), width), dtype=torch.int64, device=q.device)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        part = keys[:r1 - r0]
        _scores_kernel[(r1 - r0, width // BLOCK_N)](
            q, weights, data, scales, index_k.block_table, row_seq, seqs.query_start, seqs.seq_lens, part,
            float(scale), r0, q.stride(0), q.stride(1), weights.stride(0), index_k.block_table.stride(0),
            part.stride(0), k_sp, k_ss, ks_sp, ks_ss, ks_sg, H=h, D=d, PAGE=index_k.block_size, BLOCK_N=BLOCK_N,
            BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_D=max(16, triton.next_power_of_2(d)), FP8=fp8,
            F32=fp8 or q.dtype == torch.float32 or not q.is_cuda)  # the interpreter cannot multiply bf16
        idx = best_positions(part, k)
        out[r0:r1, :idx.shape[1]] = idx
    return out
