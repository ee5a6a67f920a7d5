"""Paged MLA prefill and chunked prefill (query_len > 1) in the expanded form: per head, keys
k = [latent @ w_uk^T, k_pe] (Dn + Dr wide) and values latent @ w_uv^T (Dv wide), then causal
flash attention over them.

Why expanded: per (query, key, head) the absorbed form costs 2 (C + Dr) + 2 C = 2176 FLOPs at
DeepSeek-V3's C 512 / Dr 64, the expanded form 2 (Dn + Dr) + 2 Dv = 640 at Dn = Dv = 128, plus the
expansion of every key once, 2 C H (Dn + Dv) FLOPs (33.5 M at H = 128). With T queries against S
keys the expansion pays for itself when T > 2 C (Dn + Dv) / (2176 - 640) = 170 queries per sequence
(a fresh 4K prompt: 0.82 TFLOP expanded against 2.3 absorbed); the short query chunks of a chunked
prefill against a long context are cheaper absorbed (the decode kernel's form), which this module
does not do yet.

Steps per group of sequences (one run of consecutive prefills from the op):
1. `_gather_kernel`: the group's latents and rope keys, read through the block tables (FP8 dequantized)
   into packed [keys, C] / [keys, Dr] buffers in the query dtype, sequence b's at rows k_start[b] ...;
   k_start is an exclusive cumsum on the device, only the total is a host number.
2. two batched torch matmuls: k_nope [H, keys, Dn] and v [H, keys, Dv] (the packed latents times each
   head's w_uk^T, w_uv^T; w_uk and w_uv may be the strided halves of kv_b_proj's weight).
3. `_mla_prefill_kernel`, program (query tile, sequence, head): BLOCK_M queries of one head, online
   softmax over BLOCK_N-key tiles (two dots per tile: q_nope . k_nope and q_pe . k_pe, k_pe shared by
   all heads), key tiles wholly visible to the whole query tile without the causal mask, the rest with
   it; query tiles launched last-first so the longest (causal) ones start first.
Memory stays bounded: a group holds at most `key_budget` keys (KEY_BUDGET_BYTES of packed and
expanded keys); a longer sequence is taken in key chunks of that size, each chunk's kernel merging
its softmax into a float32 o and lse of the sequence's queries (MERGE), so the expanded keys never
exceed the budget whatever the prompt length. No host synchronisation: lengths are read on the device,
shapes come from the host tuples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dayzero.kernels.attention._mla_decode import (LOG2E, _entry_slots, _load_entries, _softmax_update, group_width,
                                                   interpreting, operand_dtype, stream_args)
from dayzero.ops.paged import PagedStream, SeqBatch

KEY_BUDGET_BYTES = 512 << 20  # packed + expanded keys of one group
GATHER_TOKENS = 32  # keys per program of the gather
NO_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(device: torch.device) -> PrefillConfig:
    """Tiles of the prefill kernel: 128 queries x 64 keys, 8 warps (on sm_90: wgmma, 198 registers, no
    spills, 128 KiB of shared memory; tools/sass_attention_mla.py); 32 x 32 on the interpreter (its cost
    is per operation, not per element)."""
    if device.type != "cuda":
        return PrefillConfig(32, 32, 4, 1)
    return PrefillConfig(128, 64, 8, 2)


@triton.jit(do_not_specialize=['b0', 'k0', 'k1', 'stride_lt', 'stride_et'])  # values that change step to step: one compile
def _gather_kernel(lat_ptr, lat_sc_ptr, lat_tab_ptr, pe_ptr, pe_sc_ptr, pe_tab_ptr, seq_lens_ptr, k_start_ptr,
                   out_lat_ptr, out_pe_ptr, b0, k0, k1,
                   stride_lp, stride_ls, stride_lsp, stride_lss, stride_lt, lat_bs,
                   stride_ep, stride_es, stride_esp, stride_ess, stride_et, pe_bs,
                   C: tl.constexpr, DR: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DR: tl.constexpr,
                   GW_C: tl.constexpr, GW_R: tl.constexpr, FP8_LAT: tl.constexpr, FP8_PE: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    """Keys k0 + tile * BLOCK_T ... of sequence b0 + i (below min(seq_len, k1)) to packed rows
    k_start[i] + key - k0 of out_lat [keys, C] and out_pe [keys, DR]. Program (tile, i)."""
    tile, i = tl.program_id(0), tl.program_id(1)
    b = b0 + i
    hi = tl.minimum(tl.load(seq_lens_ptr + b), k1)
    tok = k0 + tile * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = tok < hi
    dst = (tl.load(k_start_ptr + i) + tok - k0).to(tl.int64)
    page, slot = _entry_slots(lat_tab_ptr, stride_lt, b, tok, valid, lat_bs)
    lat = _load_entries(lat_ptr, lat_sc_ptr, page * stride_lp + slot * stride_ls, page * stride_lsp + slot * stride_lss,
                        valid, C, BLOCK_C, BLOCK_T, GW_C, FP8_LAT, out_lat_ptr.dtype.element_ty)
    offs_c = tl.arange(0, BLOCK_C)
    tl.store(out_lat_ptr + dst[:, None] * C + offs_c[None, :], lat, mask=valid[:, None] & (offs_c < C)[None, :])
    page, slot = _entry_slots(pe_tab_ptr, stride_et, b, tok, valid, pe_bs)
    pe = _load_entries(pe_ptr, pe_sc_ptr, page * stride_ep + slot * stride_es, page * stride_esp + slot * stride_ess,
                       valid, DR, BLOCK_DR, BLOCK_T, GW_R, FP8_PE, out_pe_ptr.dtype.element_ty)
    offs_r = tl.arange(0, BLOCK_DR)
    tl.store(out_pe_ptr + dst[:, None] * DR + offs_r[None, :], pe, mask=valid[:, None] & (offs_r < DR)[None, :])


@triton.jit
def _prefill_step(qn, qp, m, l, acc, j0, kbase, k_end, pos, h, qk_scale, kn_ptr, kpe_ptr, v_ptr,
                  stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                  DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr,
                  BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Keys j0 .. j0 + BLOCK_N - 1 (those below k_end; packed row kbase + j) folded into the online softmax
    of queries at positions pos [BLOCK_M]; CAUSAL: mask keys after a query's position (tiles before
    full_end are visible to every row of the tile and skip the mask)."""
    j = j0 + tl.arange(0, BLOCK_N)
    ok = j < k_end
    rows = (kbase + j).to(tl.int64)
    dn, dr, dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    kn = tl.load(kn_ptr + rows[:, None] * stride_knt + h * stride_knh + dn[None, :],
                 mask=ok[:, None] & (dn < DN)[None, :], other=0.0).to(DOT)
    kp = tl.load(kpe_ptr + rows[:, None] * stride_kpt + dr[None, :], mask=ok[:, None] & (dr < DR)[None, :],
                 other=0.0).to(DOT)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :],
                other=0.0).to(DOT)
    s = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)
    s = tl.dot(qp, tl.trans(kp), s, input_precision=PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where((j[None, :] <= pos[:, None]) & ok[None, :], s, float("-inf"))
    return _softmax_update(s, m, l, acc, v, DOT, PRECISION)


@triton.jit(do_not_specialize=['b0', 'k0', 'k1', 'row_base', 'stride_qnt', 'stride_qpt', 'stride_knt', 'stride_kpt', 'stride_vt', 'stride_ot', 'stride_lset'])  # values that change step to step: one compile
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kn_ptr, kpe_ptr, v_ptr, o_ptr, lse_ptr,
    query_start_ptr, seq_lens_ptr, k_start_ptr,
    b0, k0, k1, row_base, qk_scale,
    stride_qnt, stride_qnh, stride_qpt, stride_qph,
    stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lset,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MERGE: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, MAX_TILES: tl.constexpr,
):
    """Program (query tile, i, head h) of sequence b = b0 + i over its keys k0 .. min(k1, seq_len) - 1 (packed
    rows k_start[i] + key - k0). Query rows query_start[b] + t; outputs at row query_start[b] + t - row_base
    of o [rows, H, DV]: the result (o's dtype), or with MERGE a float32 partial merged with the one already
    there through lse [rows, H] (log2 units). MAX_TILES (interpreter only): key tiles of the longest."""
    i, h = tl.program_id(1), tl.program_id(2).to(tl.int64)  # h * stride_knh may pass 2^31
    b = b0 + i
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    p_lo = seq_len - q_len + m0  # position of the tile's first query
    p_hi = tl.minimum(p_lo + BLOCK_M, seq_len) - 1
    if (m0 >= q_len) | (p_hi < k0):
        return
    k_end = tl.minimum(tl.minimum(k1, seq_len), p_hi + 1)
    full_end = k0 + tl.maximum(tl.minimum(p_lo + 1, k_end) - k0, 0) // BLOCK_N * BLOCK_N  # visible to every row
    kbase = tl.load(k_start_ptr + i) - k0

    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    pos = p_lo + tl.arange(0, BLOCK_M)
    rows = (q_start + offs_m).to(tl.int64)
    dn, dr, dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    qn = tl.load(qn_ptr + rows[:, None] * stride_qnt + h * stride_qnh + dn[None, :],
                 mask=row_ok[:, None] & (dn < DN)[None, :], other=0.0).to(DOT)
    qp = tl.load(qp_ptr + rows[:, None] * stride_qpt + h * stride_qph + dr[None, :],
                 mask=row_ok[:, None] & (dr < DR)[None, :], other=0.0).to(DOT)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if INTERPRET:  # Triton 3.6's interpreter cannot run a loop with bounds computed in the kernel (numpy 2.4)
        for t in range(0, MAX_TILES):
            if k0 + t * BLOCK_N < full_end:
                m, l, acc = _prefill_step(qn, qp, m, l, acc, k0 + t * BLOCK_N, kbase, k_end, pos, h, qk_scale, kn_ptr,
                                          kpe_ptr, v_ptr, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                                          DN, DR, DV, BLOCK_DN, BLOCK_DR, BLOCK_DV, BLOCK_N, False, DOT, PRECISION)
            elif k0 + t * BLOCK_N < k_end:
                m, l, acc = _prefill_step(qn, qp, m, l, acc, k0 + t * BLOCK_N, kbase, k_end, pos, h, qk_scale, kn_ptr,
                                          kpe_ptr, v_ptr, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                                          DN, DR, DV, BLOCK_DN, BLOCK_DR, BLOCK_DV, BLOCK_N, True, DOT, PRECISION)
    else:
        for j0 in range(k0, full_end, BLOCK_N):
            m, l, acc = _prefill_step(qn, qp, m, l, acc, j0, kbase, k_end, pos, h, qk_scale, kn_ptr, kpe_ptr, v_ptr,
                                      stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                                      DN, DR, DV, BLOCK_DN, BLOCK_DR, BLOCK_DV, BLOCK_N, False, DOT, PRECISION)
        for j0 in range(full_end, k_end, BLOCK_N):
            m, l, acc = _prefill_step(qn, qp, m, l, acc, j0, kbase, k_end, pos, h, qk_scale, kn_ptr, kpe_ptr, v_ptr,
                                      stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
                                      DN, DR, DV, BLOCK_DN, BLOCK_DR, BLOCK_DV, BLOCK_N, True, DOT, PRECISION)

    out_rows = (q_start + offs_m - row_base).to(tl.int64)
    o_ptrs = o_ptr + out_rows[:, None] * stride_ot + h * stride_oh + dv[None, :]
    o_mask = row_ok[:, None] & (dv < DV)[None, :]
    seen = l > 0
    o = acc / tl.where(seen, l, 1.0)[:, None]
    if MERGE:  # the first chunk holds key 0, which every query sees: after it every row's lse is finite
        lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
        lse_ptrs = lse_ptr + out_rows * stride_lset + h
        prev_lse = tl.load(lse_ptrs, mask=row_ok, other=0.0)
        top = tl.maximum(prev_lse, lse)
        w_prev, w_new = tl.exp2(prev_lse - top), tl.exp2(lse - top)
        prev = tl.load(o_ptrs, mask=o_mask, other=0.0)
        o = (prev * w_prev[:, None] + o * w_new[:, None]) / (w_prev + w_new)[:, None]
        tl.store(lse_ptrs, top + tl.log2(w_prev + w_new), mask=row_ok)
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=o_mask)


def key_groups(seq_lens: tuple[int, ...], b0: int, b1: int, budget: int) -> list[tuple[int, int]]:
    """Consecutive sequences b0 .. b1 - 1 in groups [g0, g1) of at most `budget` keys in all; a sequence
    longer than the budget is a group of its own (taken in key chunks)."""
    groups, start, keys = [], b0, 0
    for b in range(b0, b1):
        if b > start and keys + seq_lens[b] > budget:
            groups.append((start, b))
            start, keys = b, 0
        keys += seq_lens[b]
    if b1 > start:
        groups.append((start, b1))
    return groups


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_latent: PagedStream, k_pe: PagedStream,
                w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, seqs: SeqBatch, b0: int, b1: int,
                out: torch.Tensor, key_budget: int | None = None) -> None:
    """Sequences b0 .. b1 - 1 of `seqs` (each with query_len >= 1; their rows are query_start[b0] ...
    query_start[b1] - 1): writes those rows of out [N, H, Dv]. key_budget: keys per group (None: from
    KEY_BUDGET_BYTES)."""
    h, dn, c = w_uk.shape
    dv, dr = w_uv.shape[1], q_pe.shape[-1]
    if key_budget is None:
        key_budget = max(GATHER_TOKENS, KEY_BUDGET_BYTES // ((c + dr + h * (dn + dv)) * q_nope.element_size()))
    for g0, g1 in key_groups(seqs.seq_lens_host, b0, b1, key_budget):
        keys = seqs.seq_lens_host[g0]
        if g1 - g0 > 1 or keys <= key_budget:
            _attend(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, g0, g1, 0, NO_LIMIT, out, None, 0)
            continue
        r0, r1 = seqs.query_start_host[g0], seqs.query_start_host[g0 + 1]
        o = torch.zeros(r1 - r0, h, dv, dtype=torch.float32, device=out.device)
        lse = torch.full((r1 - r0, h), float("-inf"), dtype=torch.float32, device=out.device)
        for k0 in range(0, keys, key_budget):
            _attend(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, g0, g1, k0, min(keys, k0 + key_budget), o,
                    lse, r0)
        out[r0:r1] = o


def _attend(q_nope, q_pe, kv_latent: PagedStream, k_pe: PagedStream, w_uk, w_uv, scale, seqs: SeqBatch, g0, g1,
            k0, k1, o, lse, row_base) -> None:
    """Keys k0 .. k1 - 1 of sequences g0 .. g1 - 1 (module docstring, steps 1-3) into o (lse: MERGE)."""
    h, dn, c = w_uk.shape
    dv, dr = w_uv.shape[1], q_pe.shape[-1]
    dtype, device = q_nope.dtype, q_nope.device
    keys_host = [min(s, k1) - k0 for s in seqs.seq_lens_host[g0:g1]]
    lens = seqs.seq_lens[g0:g1].clamp(max=k1) - k0
    k_start = torch.cumsum(lens, 0, dtype=torch.int32) - lens
    lat = torch.empty(sum(keys_host), c, dtype=dtype, device=device)
    pe = torch.empty(sum(keys_host), dr, dtype=dtype, device=device)
    block_c, block_dr = triton.next_power_of_2(c), max(16, triton.next_power_of_2(dr))
    ls, es = stream_args(kv_latent), stream_args(k_pe)
    _gather_kernel[(triton.cdiv(max(keys_host), GATHER_TOKENS), g1 - g0)](
        *ls[:3], *es[:3], seqs.seq_lens, k_start, lat, pe, g0, k0, k1, *ls[3:], kv_latent.block_size,
        *es[3:], k_pe.block_size, C=c, DR=dr, BLOCK_C=block_c, BLOCK_DR=block_dr, GW_C=group_width(c),
        GW_R=group_width(block_dr), FP8_LAT=kv_latent.scales is not None, FP8_PE=k_pe.scales is not None,
        BLOCK_T=GATHER_TOKENS, num_warps=4)
    k_nope = torch.matmul(lat, w_uk.to(dtype).transpose(1, 2))  # [H, keys, Dn]: one GEMM per head, views of w
    v = torch.matmul(lat, w_uv.to(dtype).transpose(1, 2))  # [H, keys, Dv]
    cfg = prefill_config(device)
    dot, precision = operand_dtype(dtype)
    max_q = max(seqs.query_lens[g0:g1])
    lse_arg = lse if lse is not None else o
    _mla_prefill_kernel[(triton.cdiv(max_q, cfg.block_m), g1 - g0, h)](
        q_nope, q_pe, k_nope, pe, v, o, lse_arg, seqs.query_start, seqs.seq_lens, k_start,
        g0, k0, k1, row_base, scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(1), k_nope.stride(0), pe.stride(0), v.stride(1), v.stride(0), o.stride(0), o.stride(1),
        lse_arg.stride(0),
        DN=dn, DR=dr, DV=dv, BLOCK_DN=max(16, triton.next_power_of_2(dn)), BLOCK_DR=block_dr,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MERGE=lse is not None,
        DOT=dot, PRECISION=precision, INTERPRET=interpreting(),
        MAX_TILES=triton.cdiv(max(keys_host), cfg.block_n) if interpreting() else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
