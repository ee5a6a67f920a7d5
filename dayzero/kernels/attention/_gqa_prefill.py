"""Flash-attention prefill of paged GQA over a packed varlen step (any query lengths, cached prefixes).

A program owns one query tile of one sequence and one kv head: its BLOCK_M rows are BQ = BLOCK_M // G
consecutive query tokens x the group's G query heads (row r: token r // G, head r % G), so each key
and value tile is loaded once for the group and the tensor-core tile stays full for short chunks.
Keys are walked in BLOCK_N tiles with an online softmax in float32 (base 2), in three runs: the
tiles the sliding window cuts (masked), the tiles every row sees whole (no masks), the causal edge
(masked). Keys before the first row's window are never read (their pages may be -1); sinks join the
denominator at the end.

Program ids: the launch covers sequences first_seq .. num_seqs - 1; sequence b's tiles start at
T(b) = (query_start[b] - q_base) // BQ + (b - first_seq) (q_base = query_start[first_seq]), which grows
by at least its tile count from one sequence to the next, so the grid (num_tokens - q_base) // BQ +
(num_seqs - first_seq) (x kv heads) depends on sizes only and each program finds its sequence by a
binary search over query_start. A sequence's tiles run longest first (the last queries see the most
keys)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.attention._paged_tile import (LN2_INV, LOG2E, block_dim, load_tile, locate, mma, same_table,
                                                   stream_args)
from dayzero.kernels.attention.gqa_choose import PrefillConfig


@triton.jit
def _attend(acc, l_i, m_i, q, n0, pos, lo, hi, kvh, offs_d, offs_dv, qk_scale, window, k_ptr, ks_ptr, k_table,
            v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh, ks_sp, ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh,
            vs_sg, D: tl.constexpr, DV: tl.constexpr, PAGE_K: tl.constexpr, PAGE_V: tl.constexpr,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, K_FP8: tl.constexpr,
            V_FP8: tl.constexpr, SAME_TABLE: tl.constexpr, DOT_F32: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) into the online softmax of rows at positions pos [BLOCK_M].
    MASKED: keys outside [lo, hi) are not read, and a row sees key j only if j <= pos (and pos - j < W)."""
    tokens = n0 + tl.arange(0, BLOCK_N)
    ok = (tokens >= lo) & (tokens < hi)
    page, slot = locate(k_table, tokens, ok, PAGE_K, MASKED)
    k = load_tile(k_ptr, ks_ptr, page, slot, ok, kvh, offs_d, k_sp, k_ss, k_sh, ks_sp, ks_ss, ks_sh, ks_sg,
                  D, MASKED, K_FP8).to(q.dtype)
    s = mma(q, tl.trans(k), DOT_F32)  # scores / qk_scale (qk_scale > 0: the max commutes with it)
    if MASKED:
        seen = ok[None, :] & (tokens[None, :] <= pos[:, None])
        if HAS_WINDOW:
            seen = seen & (pos[:, None] - tokens[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0, alpha = 0
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if not SAME_TABLE:
        page, slot = locate(v_table, tokens, ok, PAGE_V, MASKED)
    v = load_tile(v_ptr, vs_ptr, page, slot, ok, kvh, offs_dv, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg,
                  DV, MASKED, V_FP8).to(q.dtype)
    acc = acc * alpha[:, None] + mma(p.to(q.dtype), v, DOT_F32)
    return acc, l_i, m_new


@triton.jit
def _attend_range(acc, l_i, m_i, q, n_lo, n_hi, pos, lo, hi, kvh, offs_d, offs_dv, qk_scale, window, k_ptr, ks_ptr,
                  k_table, v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh, ks_sp, ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh,
                  vs_sp, vs_ss, vs_sh, vs_sg, D: tl.constexpr, DV: tl.constexpr, PAGE_K: tl.constexpr,
                  PAGE_V: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  K_FP8: tl.constexpr, V_FP8: tl.constexpr, SAME_TABLE: tl.constexpr, DOT_F32: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """The key tiles n_lo, n_lo + BLOCK_N, ... below n_hi (n_lo a multiple of BLOCK_N) through `_attend`."""
    if INTERPRET:  # Triton 3.6's interpreter (numpy 2.4) cannot take loop bounds computed in the kernel
        n0 = n_lo
        while n0 < n_hi:
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, n0, pos, lo, hi, kvh, offs_d, offs_dv, qk_scale, window,
                                    k_ptr, ks_ptr, k_table, v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh, ks_sp, ks_ss,
                                    ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg, D, DV, PAGE_K, PAGE_V,
                                    BLOCK_N, MASKED, HAS_WINDOW, K_FP8, V_FP8, SAME_TABLE, DOT_F32)
            n0 += BLOCK_N
    else:
        for n0 in range(n_lo, n_hi, BLOCK_N):
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, n0, pos, lo, hi, kvh, offs_d, offs_dv, qk_scale, window,
                                    k_ptr, ks_ptr, k_table, v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh, ks_sp, ks_ss,
                                    ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg, D, DV, PAGE_K, PAGE_V,
                                    BLOCK_N, MASKED, HAS_WINDOW, K_FP8, V_FP8, SAME_TABLE, DOT_F32)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=['first_seq', 'num_seqs', 'q_base', 'stride_kt', 'stride_vt'])  # values that change step to step: one compile
def _prefill_kernel(q_ptr, k_ptr, ks_ptr, k_table_ptr, v_ptr, vs_ptr, v_table_ptr, qstart_ptr, seqlen_ptr, sinks_ptr,
                    out_ptr, qk_scale, window, first_seq, num_seqs, q_base,
                    stride_qn, stride_qh, stride_on, stride_oh, stride_kt, stride_vt,
                    k_sp, k_ss, k_sh, ks_sp, ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg,
                    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE_K: tl.constexpr,
                    PAGE_V: tl.constexpr, BLOCK_M: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_SINKS: tl.constexpr, K_FP8: tl.constexpr, V_FP8: tl.constexpr, SAME_TABLE: tl.constexpr,
                    DOT_F32: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    kvh = pid % HKV
    t = pid // HKV
    lo = pid * 0 + first_seq  # tensors, not the constexpr an argument equal to 1 becomes
    hi = pid * 0 + num_seqs - 1
    while lo < hi:  # the last sequence whose first tile is at or before t
        mid = (lo + hi + 1) // 2
        first_tile = (tl.load(qstart_ptr + mid) - q_base) // BQ + mid - first_seq
        lo = tl.where(first_tile <= t, mid, lo)
        hi = tl.where(first_tile <= t, hi, mid - 1)
    b = lo
    qs = tl.load(qstart_ptr + b)
    q_len = tl.load(qstart_ptr + b + 1) - qs
    seq_len = tl.load(seqlen_ptr + b)
    ctx = seq_len - q_len
    n_tiles = tl.cdiv(q_len, BQ)
    i = t - ((qs - q_base) // BQ + b - first_seq)
    if i >= n_tiles:
        return
    t0 = (n_tiles - 1 - i) * BQ  # first query of the tile, within the sequence

    rows = tl.arange(0, BLOCK_M)
    tok = rows // G
    qh = kvh * G + rows % G
    qi = t0 + tok
    row_ok = (tok < BQ) & (qi < q_len)
    p_min = ctx + t0
    p_max = ctx + tl.minimum(t0 + BQ, q_len) - 1
    pos = tl.minimum(ctx + qi, p_max)  # rows past the tile's last query act as that query (not stored)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (qs + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qn + qh[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_table = k_table_ptr + b.to(tl.int64) * stride_kt
    v_table = v_table_ptr + b.to(tl.int64) * stride_vt

    # keys [key_lo, key_hi) are read; [full_lo, full_hi) is seen by every row of the tile
    key_hi = p_max + 1
    full_hi = p_min + 1
    if HAS_WINDOW:
        key_lo = tl.maximum(p_min - window + 1, 0)
        full_lo = tl.maximum(p_max - window + 1, 0)
    else:
        key_lo = p_min * 0
        full_lo = p_min * 0
    a = key_lo // BLOCK_N * BLOCK_N
    bnd = tl.maximum(tl.minimum(tl.cdiv(full_lo, BLOCK_N), tl.cdiv(key_hi, BLOCK_N)) * BLOCK_N, a)
    c = tl.maximum(full_hi // BLOCK_N * BLOCK_N, bnd)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # tiles the window cuts
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, a, bnd, pos, key_lo, key_hi, kvh, offs_d, offs_dv, qk_scale,
                                  window, k_ptr, ks_ptr, k_table, v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh, ks_sp,
                                  ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg, D, DV, PAGE_K,
                                  PAGE_V, BLOCK_N, True, HAS_WINDOW, K_FP8, V_FP8, SAME_TABLE, DOT_F32, INTERPRET)
    # tiles every row sees whole
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, bnd, c, pos, key_lo, key_hi, kvh, offs_d, offs_dv, qk_scale,
                                  window, k_ptr, ks_ptr, k_table, v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh, ks_sp,
                                  ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg, D, DV, PAGE_K,
                                  PAGE_V, BLOCK_N, False, HAS_WINDOW, K_FP8, V_FP8, SAME_TABLE, DOT_F32, INTERPRET)
    # the causal edge
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, c, key_hi, pos, key_lo, key_hi, kvh, offs_d, offs_dv, qk_scale,
                                  window, k_ptr, ks_ptr, k_table, v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh, ks_sp,
                                  ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg, D, DV, PAGE_K,
                                  PAGE_V, BLOCK_N, True, HAS_WINDOW, K_FP8, V_FP8, SAME_TABLE, DOT_F32, INTERPRET)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + qh).to(tl.float32) * LOG2E
        mx = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - mx)
        l_i = l_i * alpha + tl.exp2(sink - mx)
        acc = acc * alpha[:, None]
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_on + qh[:, None] * stride_oh + offs_dv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < DV)[None, :])


def prefill(q: torch.Tensor, k, v, seqs, scale: float, sliding_window: int | None, sinks: torch.Tensor | None,
            out: torch.Tensor, first_seq: int, config: PrefillConfig) -> None:
    """out rows of sequences first_seq .. num_seqs - 1 of the step `seqs` (arguments as paged_gqa_attention;
    checked by the caller)."""
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k.entry_shape[0], v.entry_shape[1]
    group = hq // hkv
    if config.block_m < group:
        raise ValueError(f"PrefillConfig.block_m {config.block_m} must hold a query group of {group} heads")
    bq = config.block_m // group
    q_base = seqs.query_start_host[first_seq]
    tiles = (seqs.num_tokens - q_base) // bq + seqs.num_seqs - first_seq
    k_args, v_args = stream_args(k), stream_args(v)
    interpret = q.device.type != "cuda"
    _prefill_kernel[(tiles * hkv,)](
        q, k_args[0], k_args[1], k.block_table, v_args[0], v_args[1], v.block_table, seqs.query_start, seqs.seq_lens,
        sinks if sinks is not None else q, out, scale * LN2_INV, sliding_window or 0, first_seq, seqs.num_seqs, q_base,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.block_table.stride(0), v.block_table.stride(0),
        *k_args[2:], *v_args[2:],
        HKV=hkv, G=group, D=d, DV=dv, PAGE_K=k.block_size, PAGE_V=v.block_size, BLOCK_M=config.block_m, BQ=bq,
        BLOCK_N=config.block_n, BLOCK_D=block_dim(d), BLOCK_DV=block_dim(dv), HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, K_FP8=k.scales is not None, V_FP8=v.scales is not None,
        SAME_TABLE=same_table(k, v), DOT_F32=q.dtype == torch.float32 or interpret, INTERPRET=interpret,
        num_warps=config.num_warps, num_stages=config.num_stages)
