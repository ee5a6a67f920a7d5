"""Split-KV decode of paged GQA (flash-decoding): every sequence of the launch has one query.

Grid (sequence, kv head, split). A program loads the group's G query heads as one [BLOCK_H, D] tile
(BLOCK_H = G padded to 16 rows for the tensor cores), so each key and value tile is read once for the
group, and walks its share of the sequence's keys [start, seq_len) (start = seq_len - W with a window
W: pages before it are never read) in BLOCK_N tiles with an online softmax in float32 (base 2).
splits == 1: the program normalises (sinks join the denominator) and writes the output. Else it writes
float32 partials: acc [B, Hq, S, Dv] (unnormalised, relative to its max) and (max, sum) [B, Hq, S, 2]
(max -inf, sum 0 for a split with no keys), and `_reduce_kernel` combines a (sequence, query head)'s S
splits and the sink. Sizes are from the host, lengths from the device: no synchronisation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.attention._paged_tile import (LN2_INV, LOG2E, block_dim, load_tile, locate, mma, same_table,
                                                   stream_args)
from dayzero.kernels.attention.gqa_choose import DecodeConfig


@triton.jit
def _decode_step(acc, l_i, m_i, q, n0, seq_len, kvh, offs_d, offs_dv, qk_scale, k_ptr, ks_ptr, k_table, v_ptr, vs_ptr,
                 v_table, k_sp, k_ss, k_sh, ks_sp, ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg,
                 D: tl.constexpr, DV: tl.constexpr, PAGE_K: tl.constexpr, PAGE_V: tl.constexpr, BLOCK_N: tl.constexpr,
                 K_FP8: tl.constexpr, V_FP8: tl.constexpr, SAME_TABLE: tl.constexpr, DOT_F32: tl.constexpr):
    """Keys [n0, n0 + BLOCK_N) (those below seq_len, at least one) into the online softmax of the group."""
    tokens = n0 + tl.arange(0, BLOCK_N)
    ok = tokens < seq_len
    page, slot = locate(k_table, tokens, ok, PAGE_K, True)
    k = load_tile(k_ptr, ks_ptr, page, slot, ok, kvh, offs_d, k_sp, k_ss, k_sh, ks_sp, ks_ss, ks_sh, ks_sg,
                  D, True, K_FP8).to(q.dtype)
    s = tl.where(ok[None, :], mma(q, tl.trans(k), DOT_F32), float("-inf"))  # scores / qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if not SAME_TABLE:
        page, slot = locate(v_table, tokens, ok, PAGE_V, True)
    v = load_tile(v_ptr, vs_ptr, page, slot, ok, kvh, offs_dv, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg,
                  DV, True, V_FP8).to(q.dtype)
    acc = acc * alpha[:, None] + mma(p.to(q.dtype), v, DOT_F32)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=['stride_kt', 'stride_vt'])  # values that change step to step: one compile
def _decode_kernel(q_ptr, k_ptr, ks_ptr, k_table_ptr, v_ptr, vs_ptr, v_table_ptr, qstart_ptr, seqlen_ptr, sinks_ptr,
                   out_ptr, part_acc_ptr, part_ml_ptr, qk_scale, window,
                   stride_qn, stride_qh, stride_on, stride_oh, stride_kt, stride_vt,
                   k_sp, k_ss, k_sh, ks_sp, ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg,
                   HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE_K: tl.constexpr,
                   PAGE_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, K_FP8: tl.constexpr,
                   V_FP8: tl.constexpr, SAME_TABLE: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr,
                   INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    seq_len = tl.load(seqlen_ptr + b)
    row = tl.load(qstart_ptr + b).to(tl.int64)
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    else:
        start = seq_len * 0
    tiles = tl.cdiv(seq_len - start, BLOCK_N)
    per_split = tl.cdiv(tiles, splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, tiles)

    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < G
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    qh = kvh * G + heads
    q = tl.load(q_ptr + row * stride_qn + qh[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_table = k_table_ptr + b.to(tl.int64) * stride_kt
    v_table = v_table_ptr + b.to(tl.int64) * stride_vt

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    if INTERPRET:  # Triton 3.6's interpreter (numpy 2.4) cannot take loop bounds computed in the kernel
        t = t_lo
        while t < t_hi:
            acc, l_i, m_i = _decode_step(acc, l_i, m_i, q, start + t * BLOCK_N, seq_len, kvh, offs_d, offs_dv,
                                         qk_scale, k_ptr, ks_ptr, k_table, v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh,
                                         ks_sp, ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg,
                                         D, DV, PAGE_K, PAGE_V, BLOCK_N, K_FP8, V_FP8, SAME_TABLE, DOT_F32)
            t += 1
    else:
        for t in range(t_lo, t_hi):
            acc, l_i, m_i = _decode_step(acc, l_i, m_i, q, start + t * BLOCK_N, seq_len, kvh, offs_d, offs_dv,
                                         qk_scale, k_ptr, ks_ptr, k_table, v_ptr, vs_ptr, v_table, k_sp, k_ss, k_sh,
                                         ks_sp, ks_ss, ks_sh, ks_sg, v_sp, v_ss, v_sh, vs_sp, vs_ss, vs_sh, vs_sg,
                                         D, DV, PAGE_K, PAGE_V, BLOCK_N, K_FP8, V_FP8, SAME_TABLE, DOT_F32)

    dv_ok = offs_dv < DV
    if SPLIT:
        part = (b * HQ + qh) * splits + split  # [BLOCK_H]
        tl.store(part_acc_ptr + part[:, None] * DV + offs_dv[None, :], acc, mask=h_ok[:, None] & dv_ok[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_ok)
    else:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + qh, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
            mx = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - mx)
            l_i = l_i * alpha + tl.exp2(sink - mx)
            acc = acc * alpha[:, None]
        o = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_on + qh[:, None] * stride_oh + offs_dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])


@triton.jit(do_not_specialize=['splits'])  # values that change step to step: one compile
def _reduce_kernel(part_acc_ptr, part_ml_ptr, sinks_ptr, qstart_ptr, out_ptr, splits, stride_on, stride_oh,
                   HQ: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """out[query_start[b], h] = the splits' partials of (b, h) combined with the sink: a program per
    (sequence, query head)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < splits
    part = (b * HQ + h) * splits + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    mx = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E
        mx = tl.maximum(mx, sink)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # no key and no sink (an empty row): output 0, not NaN
    w = tl.exp2(m - mx)
    den = tl.sum(w * l, 0)
    if HAS_SINKS:
        den += tl.exp2(sink - mx)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    acc = tl.load(part_acc_ptr + part[:, None] * DV + offs_dv[None, :], mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    row = tl.load(qstart_ptr + b).to(tl.int64)
    tl.store(out_ptr + row * stride_on + h * stride_oh + offs_dv, o.to(out_ptr.dtype.element_ty), mask=dv_ok)


def decode(q: torch.Tensor, k, v, seqs, scale: float, sliding_window: int | None, sinks: torch.Tensor | None,
           out: torch.Tensor, num_seqs: int, config: DecodeConfig) -> None:
    """out rows of sequences 0 .. num_seqs - 1 (one query each) of the step `seqs` (arguments as
    paged_gqa_attention; checked by the caller)."""
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k.entry_shape[0], v.entry_shape[1]
    group = hq // hkv
    splits = config.splits
    split = splits > 1
    part_acc = torch.empty((num_seqs, hq, splits, dv) if split else (1,), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((num_seqs, hq, splits, 2) if split else (1,), dtype=torch.float32, device=q.device)
    k_args, v_args = stream_args(k), stream_args(v)
    interpret = q.device.type != "cuda"
    _decode_kernel[(num_seqs, hkv, splits)](
        q, k_args[0], k_args[1], k.block_table, v_args[0], v_args[1], v.block_table, seqs.query_start, seqs.seq_lens,
        sinks if sinks is not None else q, out, part_acc, part_ml, scale * LN2_INV, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.block_table.stride(0), v.block_table.stride(0),
        *k_args[2:], *v_args[2:],
        HQ=hq, G=group, D=d, DV=dv, PAGE_K=k.block_size, PAGE_V=v.block_size, BLOCK_H=block_dim(group),
        BLOCK_N=config.block_n, BLOCK_D=block_dim(d), BLOCK_DV=block_dim(dv), HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, K_FP8=k.scales is not None, V_FP8=v.scales is not None,
        SAME_TABLE=same_table(k, v), DOT_F32=q.dtype == torch.float32 or interpret, SPLIT=split, INTERPRET=interpret,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split:
        _reduce_kernel[(num_seqs, hq)](
            part_acc, part_ml, sinks if sinks is not None else q, seqs.query_start, out, splits, out.stride(0),
            out.stride(1), HQ=hq, DV=dv, BLOCK_S=triton.next_power_of_2(splits), BLOCK_DV=triton.next_power_of_2(dv),
            HAS_SINKS=sinks is not None, num_warps=4)
