"""Paged MLA decode in the absorbed form (one query per sequence): MQA of all H heads over the latent
cache, split over the keys (flash-decoding), as FlashMLA computes it.

Per sequence b (one query row r), with q_lat = q_nope @ w_uk per head (a torch bmm before the kernel):
    score[h, j] = scale * (q_lat[h] . latent[j] + q_pe[h] . k_pe[j])      keys j < seq_len[b]
    o_lat[h]    = softmax_j(score[h]) @ latent                            [H, C]
    out[h]      = w_uv[h] @ o_lat[h]                                      (a torch bmm after it)
so the keys are 576-dim (C 512 latent + Dr 64 rope) and the values the 512-dim latent itself: one
key tile read serves both products.

Kernel `_mla_decode_kernel`, program (head block, split, sequence): BLOCK_H heads of one sequence are
the M dim of both tl.dot (BLOCK_H 16..64; H = 128 runs as two head blocks side by side in the grid, so
they read the same pages from L2), BLOCK_N keys per step gathered through the block tables (any page
size; page numbers int64 so pool offsets never overflow), online softmax in float32 (exp2, the scale
folded into log2 units). The keys of sequence b are cut into SPLITS ranges of whole BLOCK_N tiles,
each split's range sized from seq_len[b] on the device, so any seq_lens are handled at a given split
count (the count is a host choice from the host lengths: a performance knob, never a correctness one).
With one split the program normalises and writes o_lat itself; otherwise it writes its normalised
partial o [R, SPLITS, H, C] float32 and lse [R, SPLITS, H] (log2 units, -inf for an empty split) and
`_mla_reduce_kernel` (program (sequence, head, 128 latent columns)) merges the splits. The partials
cost H x C x 8 bytes per split (written and read back), which bounds how finely a sequence is split.

FP8 streams (float8_e4m3fn, one float32 scale per 128 values of the entry): a key tile is loaded as
[BLOCK_N, groups, 128], multiplied by its scales in float32 and reshaped to [BLOCK_N, C] before the
dots, so the dequantized tile serves both products. Operands are the query's dtype (bf16 / fp16) on
the GPU; float32 (IEEE products) for float32 queries and under the interpreter, which holds bf16 as raw
bits (on CUDA, `supports` leaves float32 queries to the reference). No host synchronisation: every
length is read on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dayzero.kernels.devices import interpreted, sm_count
from dayzero.ops.paged import FP8_GROUP, PagedStream, SeqBatch, token_sequences

LOG2E = 1.4426950408889634
MIN_TILES_PER_SPLIT = 4  # a split reads at least this many key tiles (its partial o costs H x C x 8 bytes)
MIN_TILES_PER_SPARSE_SPLIT = 2  # gathered tiles cost more each: at batch 1 and 2048 selected keys, 16 and
# 32 splits ran in 46.0 µs against 56.6 at 8; at batch 16, 4 splits were best (105 µs) (H200, bench/dsa.py --splits)
MAX_SPLITS = 64
REDUCE_COLUMNS = 128  # latent columns per program of the split merge


def interpreting() -> bool:
    return interpreted()


@dataclass(frozen=True)
class DecodeConfig:
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(heads: int, fp8: bool, device: torch.device) -> DecodeConfig:
    """Tiles of the decode kernel (tools/sass_attention_mla.py shows registers, spills and shared memory on
    sm_90). More than 32 heads: 64 per program, the wgmma M of one warpgroup, two warpgroups splitting the
    512 latent columns (128 accumulator registers per thread); BLOCK_N 64 keys per step (a query tile plus
    two key stages: 216 KiB of shared memory), 32 for FP8 keys (dequantized in registers, which spill
    beyond). Up to 32 heads: mma.sync tiles of 16 or 32 heads, 32 keys per step (no spills)."""
    block_h = max(16, min(64, triton.next_power_of_2(heads)))
    if device.type != "cuda":  # the interpreter: its cost is per operation, not per element
        return DecodeConfig(block_h, 32, 4, 1)
    return DecodeConfig(block_h, 64 if block_h == 64 and not fp8 else 32, 8, 2)


def operand_dtype(dtype: torch.dtype):
    """(Triton dot operand dtype, input_precision) for queries of `dtype`."""
    if interpreting() or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), None


def stream_args(s: PagedStream) -> tuple:
    """(data, scales or data, block table, page stride, slot stride, scale page stride, scale slot stride,
    table row stride) of a stream, as the kernels take them."""
    sc = s.scales if s.scales is not None else s.data
    return (s.data, sc, s.block_table, s.data.stride(0), s.data.stride(1), sc.stride(0), sc.stride(1),
            s.block_table.stride(0))


def group_width(dim: int) -> int:
    """Values per FP8 scale as the kernels load them: 128, or the whole padded entry when it is narrower."""
    return min(FP8_GROUP, triton.next_power_of_2(dim))


@triton.jit
def _entry_slots(table_ptr, stride_t, b, tok, valid, block_size):
    """(page, slot), int64 [BLOCK_N], of sequence b's entries at tokens `tok` in a stream with pages of
    `block_size` tokens: page table[b, tok // block_size], slot tok % block_size (page 0 where not valid)."""
    page = tl.load(table_ptr + b * stride_t + tok // block_size, mask=valid, other=0).to(tl.int64)
    return page, (tok % block_size).to(tl.int64)


@triton.jit
def _load_entries(data_ptr, scale_ptr, rows, srows, valid, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, GW: tl.constexpr, FP8: tl.constexpr, OUT: tl.constexpr):
    """Entries [BLOCK_N, BLOCK_D] (OUT) at element offsets rows (scales at srows), zero past D and where
    not valid. FP8: loaded as [BLOCK_N, BLOCK_D // GW, GW] and scaled per group in float32."""
    if FP8:
        g = tl.arange(0, BLOCK_D // GW)
        col = g[None, :, None] * GW + tl.arange(0, GW)[None, None, :]
        x = tl.load(data_ptr + rows[:, None, None] + col, mask=valid[:, None, None] & (col < D), other=0.0)
        sc = tl.load(scale_ptr + srows[:, None] + g[None, :], mask=valid[:, None] & (g * GW < D)[None, :], other=0.0)
        x = tl.reshape(x.to(tl.float32) * sc[:, :, None], [BLOCK_N, BLOCK_D])
    else:
        col = tl.arange(0, BLOCK_D)
        x = tl.load(data_ptr + rows[:, None] + col[None, :], mask=valid[:, None] & (col < D)[None, :], other=0.0)
    return x.to(OUT)


@triton.jit
def _softmax_update(s, m, l, acc, v, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Fold scores s [M, N] (log2 units, -inf where masked) with values v [N, D] into an online softmax:
    m running max, l running sum, acc unnormalised output [M, D] float32. A row that has seen no key
    keeps m = -inf, l = 0, acc = 0."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return m_new, l * alpha + tl.sum(p, 1), tl.dot(p.to(DOT), v, acc * alpha[:, None], input_precision=PRECISION)


@triton.jit
def _decode_step(q, qpe, m, l, acc, t0, t_hi, b, qk_scale, idx_row,
                 lat_ptr, lat_sc_ptr, lat_tab_ptr, pe_ptr, pe_sc_ptr, pe_tab_ptr,
                 stride_lp, stride_ls, stride_lsp, stride_lss, stride_lt, lat_bs,
                 stride_ep, stride_es, stride_esp, stride_ess, stride_et, pe_bs,
                 C: tl.constexpr, DR: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DR: tl.constexpr,
                 GW_C: tl.constexpr, GW_R: tl.constexpr, FP8_LAT: tl.constexpr, FP8_PE: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, SPARSE: tl.constexpr):
    """One key tile, tokens t0 .. t0 + BLOCK_N - 1 (those below t_hi), folded into the online softmax
    (m, l: running max and sum in log2 units; acc: unnormalised o [BLOCK_H, BLOCK_C]). SPARSE: t0 ..
    counts selection slots of the row's indices (idx_row), whose entries (>= 0) are the tokens read."""
    tok = t0 + tl.arange(0, BLOCK_N)
    valid = tok < t_hi
    if SPARSE:
        tok = tl.load(idx_row + tok, mask=valid, other=-1)
        valid = tok >= 0
        tok = tl.maximum(tok, 0)
    page, slot = _entry_slots(lat_tab_ptr, stride_lt, b, tok, valid, lat_bs)
    k = _load_entries(lat_ptr, lat_sc_ptr, page * stride_lp + slot * stride_ls, page * stride_lsp + slot * stride_lss,
                      valid, C, BLOCK_C, BLOCK_N, GW_C, FP8_LAT, DOT)
    page, slot = _entry_slots(pe_tab_ptr, stride_et, b, tok, valid, pe_bs)
    kpe = _load_entries(pe_ptr, pe_sc_ptr, page * stride_ep + slot * stride_es, page * stride_esp + slot * stride_ess,
                        valid, DR, BLOCK_DR, BLOCK_N, GW_R, FP8_PE, DOT)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = tl.dot(qpe, tl.trans(kpe), s, input_precision=PRECISION)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    return _softmax_update(s, m, l, acc, k, DOT, PRECISION)


@triton.jit(do_not_specialize=['b0', 'SPLITS', 'stride_qr', 'stride_pr', 'stride_lt', 'stride_et', 'stride_or'])  # values that change step to step: one compile
def _mla_decode_kernel(
    q_ptr, qpe_ptr,
    lat_ptr, lat_sc_ptr, lat_tab_ptr, pe_ptr, pe_sc_ptr, pe_tab_ptr,
    seq_lens_ptr, o_ptr, lse_ptr, idx_ptr, row_seq_ptr,
    b0, H, SPLITS, qk_scale, K_SEL, stride_ir,
    stride_qh, stride_qr, stride_pr, stride_ph,
    stride_lp, stride_ls, stride_lsp, stride_lss, stride_lt, lat_bs,
    stride_ep, stride_es, stride_esp, stride_ess, stride_et, pe_bs,
    stride_or, stride_os, stride_oh,
    C: tl.constexpr, DR: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DR: tl.constexpr,
    GW_C: tl.constexpr, GW_R: tl.constexpr, FP8_LAT: tl.constexpr, FP8_PE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr, MAX_TILES: tl.constexpr,
    SPARSE: tl.constexpr,
):
    """q: q_lat [H, R, C]; qpe: q_pe [R, H, DR]; o: o_lat [H, R, C] (DIRECT) or partial o [R, SPLITS, H, C]
    float32 with lse [R, SPLITS, H]. Program (head block, split, r): sequence b0 + r; SPARSE: query row
    r of sequence row_seq[r] over its K_SEL selection slots idx[r, :] (rows of idx stride_ir apart).
    MAX_TILES (read under the interpreter only): key tiles of the longest split."""
    hb, split, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    idx_row = idx_ptr + r.to(tl.int64) * stride_ir
    if SPARSE:
        b = tl.load(row_seq_ptr + r)
        seq_len = K_SEL + b * 0
    else:
        b = b0 + r
        seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), SPLITS) * BLOCK_N
    t_lo = split * per_split
    t_hi = tl.minimum(seq_len, t_lo + per_split)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_DR)
    q = tl.load(q_ptr + heads[:, None] * stride_qh + r * stride_qr + offs_c[None, :],
                mask=h_ok[:, None] & (offs_c < C)[None, :], other=0.0).to(DOT)
    qpe = tl.load(qpe_ptr + r * stride_pr + heads[:, None] * stride_ph + offs_r[None, :],
                  mask=h_ok[:, None] & (offs_r < DR)[None, :], other=0.0).to(DOT)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    if INTERPRET:  # Triton 3.6's interpreter cannot run a loop with bounds computed in the kernel (numpy 2.4)
        for i in range(0, MAX_TILES):
            if t_lo + i * BLOCK_N < t_hi:
                m, l, acc = _decode_step(q, qpe, m, l, acc, t_lo + i * BLOCK_N, t_hi, b, qk_scale, idx_row,
                                         lat_ptr, lat_sc_ptr, lat_tab_ptr, pe_ptr, pe_sc_ptr, pe_tab_ptr,
                                         stride_lp, stride_ls, stride_lsp, stride_lss, stride_lt, lat_bs,
                                         stride_ep, stride_es, stride_esp, stride_ess, stride_et, pe_bs,
                                         C, DR, BLOCK_C, BLOCK_DR, GW_C, GW_R, FP8_LAT, FP8_PE, BLOCK_N, DOT, PRECISION,
                                         SPARSE)
    else:
        for t0 in range(t_lo, t_hi, BLOCK_N):
            m, l, acc = _decode_step(q, qpe, m, l, acc, t0, t_hi, b, qk_scale, idx_row,
                                     lat_ptr, lat_sc_ptr, lat_tab_ptr, pe_ptr, pe_sc_ptr, pe_tab_ptr,
                                     stride_lp, stride_ls, stride_lsp, stride_lss, stride_lt, lat_bs,
                                     stride_ep, stride_es, stride_esp, stride_ess, stride_et, pe_bs,
                                     C, DR, BLOCK_C, BLOCK_DR, GW_C, GW_R, FP8_LAT, FP8_PE, BLOCK_N, DOT, PRECISION,
                                         SPARSE)

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_mask = h_ok[:, None] & (offs_c < C)[None, :]
    if DIRECT:
        tl.store(o_ptr + heads[:, None] * stride_oh + r * stride_or + offs_c[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptr + r * stride_or + split * stride_os + heads[:, None] * stride_oh + offs_c[None, :], o,
                 mask=o_mask)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + (r * SPLITS + split) * H + heads, lse, mask=h_ok)


@triton.jit(do_not_specialize=['SPLITS', 'stride_or', 'stride_xr'])  # values that change step to step: one compile
def _mla_reduce_kernel(o_ptr, lse_ptr, out_ptr, SPLITS, H, stride_or, stride_os, stride_oh, stride_xh, stride_xr,
                       C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[h, r, c] = sum over splits s of o[r, s, h, c] * 2^(lse[r, s, h] - lse_total): program (r, h, chunk
    of BLOCK_C columns), all splits in one [BLOCK_S, BLOCK_C] tile. Split 0 of a sequence is never empty
    (seq_len >= 1); a sparse row may have no selected key at all (every lse -inf): it gets zeros. An
    empty split has lse -inf (weight 0) and o 0."""
    r, h = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    lse = tl.load(lse_ptr + (r * SPLITS + offs_s) * H + h, mask=offs_s < SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(o_ptr + r * stride_or + offs_s[:, None] * stride_os + h * stride_oh + offs_c[None, :],
                mask=(offs_s < SPLITS)[:, None] & (offs_c < C)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + h * stride_xh + r * stride_xr + offs_c, out.to(out_ptr.dtype.element_ty), mask=offs_c < C)


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, stride_h: int, stride_r: int) -> None:
    """Merge the normalized partials part [R, SPLITS, H, C] (float32) by their lse [R, SPLITS, H] (base 2)
    into out (row r, head h at out's r * stride_r + h * stride_h, unit-stride columns)."""
    rows, splits, h, c = part.shape
    block_c = min(REDUCE_COLUMNS, triton.next_power_of_2(c))
    _mla_reduce_kernel[(rows, h, triton.cdiv(c, block_c))](
        part, lse, out, splits, h, part.stride(0), part.stride(1), part.stride(2), stride_h, stride_r, C=c,
        BLOCK_C=block_c, BLOCK_S=triton.next_power_of_2(splits), num_warps=4)


def num_splits(max_len: int, rows: int, head_blocks: int, block_n: int, device: torch.device,
               min_tiles: int = MIN_TILES_PER_SPLIT) -> int:
    """Key splits per sequence: enough programs for one wave over the SMs (4 on the interpreter, so
    tests exercise the merge), each split at least MIN_TILES_PER_SPLIT tiles of the longest sequence."""
    slots = sm_count(device) if device.type == "cuda" else 4
    splits = max(1, slots // max(1, rows * head_blocks))
    return max(1, min(splits, MAX_SPLITS, triton.cdiv(triton.cdiv(max_len, block_n), min_tiles)))


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_latent: PagedStream, k_pe: PagedStream,
               w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, seqs: SeqBatch, b0: int, b1: int,
               out: torch.Tensor, splits: int | None = None) -> None:
    """Sequences b0 .. b1 - 1 of `seqs`, each with exactly one query (rows query_start[b0] + 0 .. b1 - b0 - 1,
    checked by the caller on the host tuples): writes their rows of out [N, H, Dv]. splits: key splits
    per sequence (None: `num_splits`)."""
    r0 = seqs.query_start_host[b0]
    _attend(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, r0, b1 - b0, max(seqs.seq_lens_host[b0:b1]),
            out, splits, b0=b0)


def mla_sparse(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_latent: PagedStream, k_pe: PagedStream,
               w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, seqs: SeqBatch, indices: torch.Tensor,
               out: torch.Tensor, splits: int | None = None) -> None:
    """paged_sparse_mla_attention: every query row of the step over its own selected keys, indices
    [N, K] (int32, positions within the row's sequence, -1 unused), the same kernel with the key tiles
    read through the indices (SPARSE): rows of a prefill each run as a decode would."""
    n, k = indices.shape
    _attend(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, 0, n, k, out, splits, indices=indices,
            row_seq=token_sequences(seqs))


def _attend(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, r0, rows, max_len, out, splits, *, b0=0,
            indices=None, row_seq=None) -> None:
    """Rows r0 .. r0 + rows - 1 of out: sequences b0 + r (dense), or query rows over indices (sparse)."""
    (h, _, c), dr = w_uk.shape, q_pe.shape[-1]
    dtype, device = q_nope.dtype, q_nope.device
    cfg = decode_config(h, kv_latent.scales is not None, device)
    dot, precision = operand_dtype(dtype)
    q_lat = torch.bmm(q_nope[r0:r0 + rows].transpose(0, 1), w_uk.to(dtype))  # [H, R, C]
    qpe = q_pe[r0:r0 + rows]
    head_blocks = triton.cdiv(h, cfg.block_h)
    if splits is None:
        splits = num_splits(max_len, rows, head_blocks, cfg.block_n, device,
                            MIN_TILES_PER_SPARSE_SPLIT if indices is not None else MIN_TILES_PER_SPLIT)
    o_lat = torch.empty(h, rows, c, dtype=dtype, device=device)
    if splits == 1:
        part, lse = o_lat, o_lat
        o_strides = (o_lat.stride(1), 0, o_lat.stride(0))
    else:
        part = torch.empty(rows, splits, h, c, dtype=torch.float32, device=device)
        lse = torch.empty(rows, splits, h, dtype=torch.float32, device=device)
        o_strides = (part.stride(0), part.stride(1), part.stride(2))
    lat, pe = stream_args(kv_latent), stream_args(k_pe)
    sparse = indices is not None
    _mla_decode_kernel[(head_blocks, splits, rows)](
        q_lat, qpe, *lat[:3], *pe[:3], seqs.seq_lens, part, lse, indices if sparse else seqs.seq_lens,
        row_seq if sparse else seqs.seq_lens, b0, h, splits, scale * LOG2E, max_len if sparse else 0,
        indices.stride(0) if sparse else 0,
        q_lat.stride(0), q_lat.stride(1), qpe.stride(0), qpe.stride(1),
        *lat[3:], kv_latent.block_size, *pe[3:], k_pe.block_size, *o_strides,
        C=c, DR=dr, BLOCK_C=triton.next_power_of_2(c), BLOCK_DR=max(16, triton.next_power_of_2(dr)),
        GW_C=group_width(c), GW_R=group_width(max(16, dr)),
        FP8_LAT=kv_latent.scales is not None, FP8_PE=k_pe.scales is not None,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DIRECT=splits == 1, DOT=dot, PRECISION=precision,
        INTERPRET=interpreting(),
        MAX_TILES=triton.cdiv(triton.cdiv(max_len, cfg.block_n), splits) if interpreting() else 0,
        SPARSE=sparse, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        merge_splits(part, lse, o_lat, o_lat.stride(0), o_lat.stride(1))
    out[r0:r0 + rows] = torch.bmm(o_lat, w_uv.to(dtype).transpose(1, 2)).transpose(0, 1)
