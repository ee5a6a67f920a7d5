"""v4_index_topk (dayzero/ops/attention_v4.py) on CUDA: the CSA indexer's scores of the block's gathered
index keys, reduced over the heads in the kernel, written as int64 order keys, then the top-k.

One program per (query row, BLOCK_N entries) of a chunk of rows: score[n] = sum_h w[h] H^-1/2 relu(q[h] .
key[n]) Di^-1/2 in float32 (bf16 / fp16 products on the tensor cores, IEEE float32 for float32 queries),
entries not visible to the query (its number n - (N - lens) outside [0, (p + 1) // ratio)) INT64_MIN. The
keys are DSA's (dayzero/kernels/dsa/_index.py: sortable score bits, then the entry's column, lower
first), so torch.topk ranks equal scores
as the reference's `ranked_topk` does. Rows are chunked so that a chunk's keys stay within SCORE_BYTES
(the reference's [B, T, H, N] float32 scores are what the chunks avoid)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.attention._mla_decode import operand_dtype
from dayzero.kernels.dsa._index import INT64_MIN, _order_key
from dayzero.kernels.dsa._topk import best_positions

BLOCK_N = 64
SCORE_BYTES = 1 << 29


@triton.jit
def _score(k_rows, ok, q_ptr, w_ptr, row, H, scale, head_scale, D: tl.constexpr, BLOCK_H: tl.constexpr,
           BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """[BLOCK_N] float32 indexer scores of the keys whose rows start at k_rows [BLOCK_N, 1] (`ok` the ones
    to read) against row `row`'s heads: sum_h w[h] head_scale relu(q[h] . k) scale."""
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_rows + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
    return _score_values(k, q_ptr, w_ptr, row, H, scale, head_scale, D, BLOCK_H, BLOCK_D, DOT, PRECISION)


@triton.jit
def _score_values(k, q_ptr, w_ptr, row, H, scale, head_scale, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """`_score` of a loaded key tile k [BLOCK_N, BLOCK_D] (0 where not read)."""
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    heads = tl.arange(0, BLOCK_H)
    hm = heads < H
    q = tl.load(q_ptr + (row * H + heads[:, None]) * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    w = tl.load(w_ptr + row * H + heads, mask=hm, other=0.0).to(tl.float32) * head_scale
    s = tl.dot(k.to(DOT), tl.trans(q.to(DOT)), input_precision=PRECISION)  # [BLOCK_N, BLOCK_H]
    s = tl.maximum(s, 0.0) * scale
    return tl.sum(s * w[None, :], 1)


@triton.jit
def _scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, len_ptr, out_ptr, r0, T, N, H, scale, head_scale, ratio, stride_on,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   HAS_LEN: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = r0 + i  # b * T + t
    b = row // T
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seen = (tl.load(pos_ptr + row) + 1) // ratio
    shift = 0
    if HAS_LEN:
        shift = N - tl.load(len_ptr + b)
    number = cols - shift
    ok = (cols < N) & (number >= 0) & (number < seen)
    score = _score(k_ptr + (b * N + cols[:, None]) * D, ok, q_ptr, w_ptr, row, H, scale, head_scale, D, BLOCK_H,
                   BLOCK_D, DOT, PRECISION)
    tl.store(out_ptr + i * stride_on + cols, tl.where(ok, _order_key(score, cols), INT64_MIN))


def v4_index_topk(q, keys, weights, positions, ratio, k, lens=None):
    """As dayzero.ops.attention_v4.v4_index_topk (checked by `supports`)."""
    b, t, h, d = q.shape
    n = keys.shape[1]
    k = min(k, n)
    out = torch.full((b * t, k), -1, dtype=torch.int64, device=q.device)
    if out.numel() == 0:
        return out.view(b, t, k)
    dot, precision = operand_dtype(q.dtype)
    block_n = BLOCK_N if precision is None else BLOCK_N // 4  # IEEE float32 products: a smaller tile (no spills)
    width = triton.cdiv(n, block_n) * block_n
    rows = b * t
    chunk = max(1, SCORE_BYTES // (8 * width))
    scores = torch.empty((min(chunk, rows), width), dtype=torch.int64, device=q.device)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        part = scores[:r1 - r0]
        _scores_kernel[(r1 - r0, width // block_n)](
            q, weights, keys, positions, lens if lens is not None else positions, part, r0, t, n, h, d ** -0.5,
            h ** -0.5, int(ratio), part.stride(0), D=d, BLOCK_N=block_n, BLOCK_H=max(16, triton.next_power_of_2(h)),
            BLOCK_D=max(16, triton.next_power_of_2(d)), HAS_LEN=lens is not None, DOT=dot, PRECISION=precision)
        out[r0:r1] = best_positions(part, k)
    return out.view(b, t, k)
