"""sparse_attention (dayzero/ops/attention_v4.py) in one launch over a block's gathered rows: one program
per (query, BLOCK_H heads), an online softmax that starts from the heads' sink logits (weight exp(sink),
no value) and runs over
  - the query's window keys (at most sliding_window of them, from max(its index - window + 1, the row's
    first valid key) to itself: WINDOW_TILES tiles of BLOCK_N),
  - then CSA's chosen entries (indices, -1 unused: cdiv(k, BLOCK_N) tiles), or HCA's visible entries
    (entry n seen while its number n - (N - lens) is in [0, (p + 1) // ratio): a loop over N's tiles),
the keys being the values. Scores q.k * scale in float32 (bf16 / fp16 products on the tensor cores,
IEEE float32 for float32 queries and under the interpreter), the weights cast to the dot dtype for the
weighted sum as FlashAttention does, the output divided by the softmax's sum and cast to q's dtype.
The window's and CSA's tile counts are compile-time (fixed per model); HCA's loop runs to N (under the
interpreter, which loops only to constant bounds, to a compile-time count)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.attention._mla_decode import interpreting, operand_dtype

BLOCK_N = 16  # keys a tile (D = 512: a wider tile spills on sm_90)
NEG = tl.constexpr(-1e30)  # a finite -inf: no NaN from a tile with nothing visible


@triton.jit
def _tile(q, acc, m, l, k_ptrs, ok, dm, qk_scale, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys (= values) [BLOCK_N, D] at k_ptrs, `ok` the visible ones: the online softmax step."""
    k = tl.load(k_ptrs, mask=ok[:, None] & dm[None, :], other=0.0)
    return _tile_values(q, acc, m, l, k, ok, qk_scale, DOT, PRECISION)


@triton.jit
def _tile_values(q, acc, m, l, k, ok, qk_scale, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax step over a loaded tile k [BLOCK_N, D] (0 where not `ok`)."""
    s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
    s = tl.where(ok[None, :], s, NEG)
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.where(ok[None, :], tl.exp2(s - m_new[:, None]), 0.0)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), k.to(DOT), input_precision=PRECISION)
    return acc, m_new, l


@triton.jit
def _start(q_ptr, sink_ptr, row, H, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's heads (and mask), dims (and mask), its query tile q [BLOCK_H, BLOCK_D] of row `row`, and
    the online softmax's start from the sinks: acc 0, max m = sink (base 2), sum l = 1 (the sink's weight)."""
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < H
    cols = tl.arange(0, BLOCK_D)
    dm = cols < D
    q = tl.load(q_ptr + (row * H + heads[:, None]) * D + cols[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    LOG2E: tl.constexpr = 1.4426950408889634
    m = tl.load(sink_ptr + heads, mask=hm, other=0.0).to(tl.float32) * LOG2E
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    return heads, hm, cols, dm, q, acc, m, l


@triton.jit
def _csa_tile(q, acc, m, l, comp_ptr, idx_ptr, row, b, i, n, N, cols, dm, qk_scale, D: tl.constexpr, TOPK: tl.constexpr,
              BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    j = i * BLOCK_N + n
    idx = tl.load(idx_ptr + row * TOPK + j, mask=j < TOPK, other=-1)
    ok = idx >= 0
    return _tile(q, acc, m, l, comp_ptr + (b * N + tl.maximum(idx, 0)[:, None]) * D + cols[None, :], ok, dm, qk_scale,
                 DOT, PRECISION)


@triton.jit
def _hca_tile(q, acc, m, l, comp_ptr, b, i, n, N, shift, seen, cols, dm, qk_scale, D: tl.constexpr,
              BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    e = i * BLOCK_N + n
    number = e - shift
    ok = (e < N) & (number >= 0) & (number < seen)
    return _tile(q, acc, m, l, comp_ptr + (b * N + e[:, None]) * D + cols[None, :], ok, dm, qk_scale, DOT, PRECISION)


@triton.jit
def _attention_kernel(q_ptr, kv_ptr, sink_ptr, comp_ptr, idx_ptr, pos_ptr, kvlen_ptr, clen_ptr, out_ptr,
                      T, S, N, H, qk_scale, ratio,
                      D: tl.constexpr, WINDOW: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, WINDOW_TILES: tl.constexpr, EXTRA_TILES: tl.constexpr,
                      MODE: tl.constexpr, TOPK: tl.constexpr, HAS_KVLEN: tl.constexpr, HAS_CLEN: tl.constexpr,
                      DOT: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * T + t
    b, t = row // T, row % T
    heads, hm, cols, dm, q, acc, m, l = _start(q_ptr, sink_ptr, row, H, D, BLOCK_H, BLOCK_D)
    me = S - T + t  # the query's index among the window keys
    first = tl.maximum(me - (WINDOW - 1), 0)
    if HAS_KVLEN:
        first = tl.maximum(first, S - tl.load(kvlen_ptr + b))
    n = tl.arange(0, BLOCK_N)
    for i in tl.static_range(WINDOW_TILES):
        keys = first + i * BLOCK_N + n
        ok = keys <= me
        acc, m, l = _tile(q, acc, m, l, kv_ptr + (b * S + keys[:, None]) * D + cols[None, :], ok, dm, qk_scale,
                          DOT, PRECISION)
    if MODE == 1:  # CSA: the chosen entries
        if INTERPRET:
            for i in tl.static_range(EXTRA_TILES):
                acc, m, l = _csa_tile(q, acc, m, l, comp_ptr, idx_ptr, row, b, i, n, N, cols, dm, qk_scale, D, TOPK,
                                      BLOCK_N, DOT, PRECISION)
        else:
            for i in range(0, EXTRA_TILES):
                acc, m, l = _csa_tile(q, acc, m, l, comp_ptr, idx_ptr, row, b, i, n, N, cols, dm, qk_scale, D, TOPK,
                                      BLOCK_N, DOT, PRECISION)
    if MODE == 2:  # HCA: every visible entry
        seen = (tl.load(pos_ptr + row) + 1) // ratio
        shift = 0
        if HAS_CLEN:
            shift = N - tl.load(clen_ptr + b)
        if INTERPRET:  # the interpreter loops to constant bounds only
            for i in tl.static_range(EXTRA_TILES):
                acc, m, l = _hca_tile(q, acc, m, l, comp_ptr, b, i, n, N, shift, seen, cols, dm, qk_scale, D, BLOCK_N,
                                      DOT, PRECISION)
        else:
            for i in range(0, tl.cdiv(N, BLOCK_N)):
                acc, m, l = _hca_tile(q, acc, m, l, comp_ptr, b, i, n, N, shift, seen, cols, dm, qk_scale, D, BLOCK_N,
                                      DOT, PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + (row * H + heads[:, None]) * D + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & dm[None, :])


def sparse_attention(q, kv, sinks, scale, sliding_window, compressed=None, indices=None, positions=None, ratio=None,
                     kv_lens=None, compressed_lens=None):
    """As dayzero.ops.attention_v4.sparse_attention (checked there and by `supports`)."""
    b, t, h, d = q.shape
    s = kv.shape[1]
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    mode = 0 if compressed is None else (1 if indices is not None else 2)
    if mode == 1:
        indices = indices.contiguous()  # the top-k's slice of a sorted row
    n = 0 if compressed is None else compressed.shape[1]
    topk = indices.shape[-1] if mode == 1 else 0
    extra = 0
    if mode == 1:
        extra = triton.cdiv(topk, BLOCK_N)
    elif mode == 2 and interpreting():
        extra = triton.cdiv(n, BLOCK_N)
    dot, precision = operand_dtype(q.dtype)
    block_h = 16
    dummy = q
    _attention_kernel[(b * t, triton.cdiv(h, block_h))](
        q, kv, sinks, compressed if compressed is not None else dummy, indices if mode == 1 else dummy,
        positions if mode == 2 else dummy, kv_lens if kv_lens is not None else dummy,
        compressed_lens if compressed_lens is not None else dummy, out, t, s, n, h, float(scale) * 1.4426950408889634,
        int(ratio or 1), D=d, WINDOW=int(sliding_window), BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=BLOCK_N, WINDOW_TILES=triton.cdiv(int(sliding_window), BLOCK_N),
        EXTRA_TILES=extra, MODE=mode, TOPK=topk, HAS_KVLEN=kv_lens is not None, HAS_CLEN=compressed_lens is not None,
        DOT=dot, PRECISION=precision, INTERPRET=interpreting(), num_warps=8)
    return out
