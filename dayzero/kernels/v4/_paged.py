"""paged_v4_index_topk and paged_v4_attention (dayzero/ops/attention_v4_paged.py) on CUDA: a decode step's
rows read the paged streams in place, through their block tables (no gather), with every size taken
from the host's launch arguments and every length from the device (positions), so a captured graph
replays for any context up to its width.

Where entry e of a stream of rate r sits: its last token t = e * r + r - 1, page table[b, t // block_size],
slot (t % block_size) // r (0 where a page holds one entry), as PagedStream.locations.

    _index_kernel      one program per (row, BLOCK_N entries): the CSA indexer's score of each entry
                       visible to the row (number < (p + 1) // ratio) against all heads, reduced over the
                       heads in float32 (v4/_index.py's math and DSA's int64 order keys), INT64_MIN
                       elsewhere; then torch.topk of each row (dsa/_topk.py), -1 padded to k columns
    _attention_kernel  one program per (row, BLOCK_H heads, split): v4/_attention.py's online softmax over
                       the row's tiles, the window's tokens (cdiv(window, BLOCK_N) tiles) then CSA's chosen
                       entries (cdiv(k, BLOCK_N) tiles) or HCA's visible ones (to the row's count), split
                       over programs so that a small batch fills the GPU (one split for prompt chunks) and
                       merged by MLA's split merge (_mla_decode.merge_splits), the sinks' weight in split 0;
                       under the interpreter, which loops to constant bounds, each split to the launch's
                       most tiles a split

Streams of q's dtype, or FP8 with one float32 scale per FP8_GROUP values (dequantized and rounded to q's
dtype as PagedStream.read returns them); q's dtype for the products."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.attention._mla_decode import interpreting, merge_splits, num_splits, operand_dtype
from dayzero.kernels.dsa._index import INT64_MIN, _order_key
from dayzero.kernels.dsa._topk import best_positions
from dayzero.kernels.v4._attention import NEG, _start, _tile_values
from dayzero.kernels.v4._index import _score_values
from dayzero.ops.paged import FP8_GROUP

INDEX_BLOCK_N = 64
BLOCK_N = 16  # attention keys a tile (D = 512, as v4/_attention.py)
MIN_TILES_PER_SPLIT = 2  # a row's tiles per program at least, when split over programs
SCORE_BYTES = 1 << 29  # int64 keys a chunk of rows holds at most
GROUP = tl.constexpr(FP8_GROUP)  # values an FP8 stream's scale covers


@triton.jit
def _entries(data_ptr, scale_ptr, table_ptr, row, stride_t, entry, ok, cols, dm, stride_p, stride_s, sstride_p,
             sstride_s, RATE: tl.constexpr, PAGE: tl.constexpr, PER_BLOCK: tl.constexpr, FP8: tl.constexpr,
             DTYPE: tl.constexpr):
    """Entries `entry` [BLOCK_N] of sequence `row` of a paged stream, [BLOCK_N, BLOCK_D] in DTYPE (0 where
    not ok): found through the table (their last token's page, PagedStream.locations); an FP8 stream's
    values times their group's scale in float32, rounded to DTYPE as PagedStream.read returns them."""
    token = tl.where(ok, entry, 0) * RATE + (RATE - 1)
    page = tl.load(table_ptr + row * stride_t + token // PAGE, mask=ok, other=0).to(tl.int64)
    page = tl.maximum(page, 0)
    slot = 0
    if PER_BLOCK > 1:
        slot = (token % PAGE) // RATE
    mask = ok[:, None] & dm[None, :]
    x = tl.load(data_ptr + (page * stride_p + slot * stride_s)[:, None] + cols[None, :], mask=mask, other=0.0)
    if FP8:
        srow = page * sstride_p + slot * sstride_s
        sc = tl.load(scale_ptr + srow[:, None] + (cols // GROUP)[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32) * sc
    return x.to(DTYPE)


@triton.jit
def _seq_of(seq_ptr, row, HAS_SEQ: tl.constexpr):
    """The sequence (block-table row) of query row `row`: rows_seq[row], or the row itself."""
    if HAS_SEQ:
        return tl.load(seq_ptr + row).to(tl.int64)
    else:
        return row


@triton.jit
def _index_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, table_ptr, pos_ptr, seq_ptr, out_ptr, r0, H, scale, head_scale,
                  stride_t, stride_p, stride_s, sstride_p, sstride_s, stride_on, D: tl.constexpr, RATE: tl.constexpr,
                  PAGE: tl.constexpr, PER_BLOCK: tl.constexpr, FP8: tl.constexpr, HAS_SEQ: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
                  PRECISION: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = r0 + i
    seq = _seq_of(seq_ptr, row, HAS_SEQ)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seen = (tl.load(pos_ptr + row) + 1) // RATE
    ok = cols < seen
    d = tl.arange(0, BLOCK_D)
    k = _entries(k_ptr, ks_ptr, table_ptr, seq, stride_t, cols, ok, d, d < D, stride_p, stride_s, sstride_p,
                 sstride_s, RATE, PAGE, PER_BLOCK, FP8, q_ptr.dtype.element_ty)
    score = _score_values(k, q_ptr, w_ptr, row, H, scale, head_scale, D, BLOCK_H, BLOCK_D, DOT, PRECISION)
    tl.store(out_ptr + i * stride_on + cols, tl.where(ok, _order_key(score, cols), INT64_MIN))


def _scale_args(stream) -> tuple:
    """(scales or data, their page and slot strides, FP8): what the kernels take of a stream's scales."""
    if stream.scales is None:
        return stream.data, 0, 0, False
    return stream.scales, stream.scales.stride(0), stream.scales.stride(1), True


def paged_v4_index_topk(q, keys, weights, positions, ratio, k, rows_seq=None, max_entries: int | None = None):
    """As dayzero.ops.attention_v4_paged.paged_v4_index_topk (checked by `supports`). max_entries: the most
    entries a row may see (the host's bound on the launch; default from the table's width)."""
    b, h, d = q.shape
    out = torch.full((b, k), -1, dtype=torch.int64, device=q.device)
    if b == 0:
        return out
    rate, page = int(ratio), keys.block_size
    if max_entries is None:
        max_entries = keys.block_table.shape[1] * page // rate
    width = max(INDEX_BLOCK_N, triton.cdiv(max_entries, INDEX_BLOCK_N) * INDEX_BLOCK_N)
    dot, precision = operand_dtype(q.dtype)
    block_n = INDEX_BLOCK_N if precision is None else INDEX_BLOCK_N // 4  # IEEE float32 products: no spills
    chunk = max(1, SCORE_BYTES // (8 * width))
    scores = torch.empty((min(chunk, b), width), dtype=torch.int64, device=q.device)
    data, table = keys.data, keys.block_table
    scales, ssp, sss, fp8 = _scale_args(keys)
    for r0 in range(0, b, chunk):
        r1 = min(b, r0 + chunk)
        part = scores[:r1 - r0]
        _index_kernel[(r1 - r0, width // block_n)](
            q, weights, data, scales, table, positions, rows_seq if rows_seq is not None else positions, part, r0, h, d ** -0.5, h ** -0.5, table.stride(0),
            data.stride(0), data.stride(1), ssp, sss, part.stride(0), D=d, RATE=rate, PAGE=page,
            PER_BLOCK=keys.per_block, FP8=fp8, HAS_SEQ=rows_seq is not None, BLOCK_N=block_n,
            BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_D=max(16, triton.next_power_of_2(d)), DOT=dot,
            PRECISION=precision)
        idx = best_positions(part, k)
        out[r0:r1, :idx.shape[1]] = idx
    return out


@triton.jit
def _row_tile(q, acc, m, l, t, live, n, p, first, seen, w_ptr, ws_ptr, w_table, c_ptr, cs_ptr, c_table, idx_ptr,
              row, seq, cols, dm, qk_scale, stride_wt, stride_wp, stride_ws, sstride_wp, sstride_ws, stride_ct,
              stride_cp, stride_cs, sstride_cp, sstride_cs, W_PAGE: tl.constexpr, W_PER_BLOCK: tl.constexpr,
              W_FP8: tl.constexpr, RATE: tl.constexpr, C_PAGE: tl.constexpr, C_PER_BLOCK: tl.constexpr,
              C_FP8: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW_TILES: tl.constexpr, MODE: tl.constexpr,
              TOPK: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Tile t of a row's keys: window tiles first (tokens from `first`), then CSA's chosen entries or HCA's
    visible ones; `live` False reads nothing."""
    if t < WINDOW_TILES:
        tok = first + t * BLOCK_N + n
        ok = (tok <= p) & live
        k = _entries(w_ptr, ws_ptr, w_table, seq, stride_wt, tok, ok, cols, dm, stride_wp, stride_ws, sstride_wp,
                     sstride_ws, 1, W_PAGE, W_PER_BLOCK, W_FP8, q.dtype)
    else:
        j = (t - WINDOW_TILES) * BLOCK_N + n
        if MODE == 1:  # CSA: the chosen entries (-1 unused; never past what the row sees)
            e = tl.load(idx_ptr + row * TOPK + j, mask=(j < TOPK) & live, other=-1)
            ok = (e >= 0) & (e < seen)
        else:  # HCA: every visible entry
            e = j
            ok = (e < seen) & live
        k = _entries(c_ptr, cs_ptr, c_table, seq, stride_ct, e, ok, cols, dm, stride_cp, stride_cs, sstride_cp,
                     sstride_cs, RATE, C_PAGE, C_PER_BLOCK, C_FP8, q.dtype)
    return _tile_values(q, acc, m, l, k, ok, qk_scale, DOT, PRECISION)


@triton.jit(do_not_specialize=["PER", "stride_or"])  # values that change step to step: one compile
def _attention_kernel(q_ptr, w_ptr, ws_ptr, w_table, sink_ptr, c_ptr, cs_ptr, c_table, idx_ptr, pos_ptr, seq_ptr,
                      out_ptr, lse_ptr, H, PER,
                      qk_scale, stride_wt, stride_wp, stride_ws, sstride_wp, sstride_ws, stride_ct, stride_cp,
                      stride_cs, sstride_cp, sstride_cs, stride_or, stride_os,
                      D: tl.constexpr, WINDOW: tl.constexpr, W_PAGE: tl.constexpr, W_PER_BLOCK: tl.constexpr,
                      W_FP8: tl.constexpr, RATE: tl.constexpr, C_PAGE: tl.constexpr, C_PER_BLOCK: tl.constexpr,
                      C_FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                      WINDOW_TILES: tl.constexpr, EXTRA_TILES: tl.constexpr, MODE: tl.constexpr, TOPK: tl.constexpr,
                      HAS_SEQ: tl.constexpr, DIRECT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                      INTERPRET: tl.constexpr, MAX_TILES: tl.constexpr):
    """Program (row, head block, split): tiles split * PER .. of the row's window + compressed tiles. DIRECT
    (one split): out [N, H, D]; else the split's normalized partial [N, SPLITS, H, D] float32 and its lse
    (base 2; split 0 holds the sink's weight, an empty split -inf) for the merge."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    seq = _seq_of(seq_ptr, row, HAS_SEQ)
    heads, hm, cols, dm, q, acc, m, l = _start(q_ptr, sink_ptr, row, H, D, BLOCK_H, BLOCK_D)
    m = tl.where(split == 0, m, NEG)  # the sink's weight once per row: in split 0
    l = tl.where(split == 0, l, 0.0)
    p = tl.load(pos_ptr + row)
    first = tl.maximum(p - (WINDOW - 1), 0)
    seen = (p + 1) // RATE
    tiles = WINDOW_TILES + EXTRA_TILES
    if MODE == 2:
        tiles = WINDOW_TILES + tl.cdiv(seen, BLOCK_N)
    t_lo = split * PER
    t_hi = tl.minimum(t_lo + PER, tiles)
    n = tl.arange(0, BLOCK_N)
    if INTERPRET:  # the interpreter loops only to bounds known on the host
        for i in tl.static_range(MAX_TILES):
            acc, m, l = _row_tile(q, acc, m, l, t_lo + i, t_lo + i < t_hi, n, p, first, seen, w_ptr, ws_ptr,
                                  w_table, c_ptr, cs_ptr, c_table, idx_ptr, row, seq, cols, dm, qk_scale, stride_wt,
                                  stride_wp, stride_ws, sstride_wp, sstride_ws, stride_ct, stride_cp, stride_cs,
                                  sstride_cp, sstride_cs, W_PAGE, W_PER_BLOCK, W_FP8, RATE, C_PAGE, C_PER_BLOCK,
                                  C_FP8, BLOCK_N, WINDOW_TILES, MODE, TOPK, DOT, PRECISION)
    else:
        for t in range(t_lo, t_hi):
            acc, m, l = _row_tile(q, acc, m, l, t, True, n, p, first, seen, w_ptr, ws_ptr, w_table, c_ptr, cs_ptr,
                                  c_table, idx_ptr, row, seq, cols, dm, qk_scale, stride_wt, stride_wp, stride_ws,
                                  sstride_wp, sstride_ws, stride_ct, stride_cp, stride_cs, sstride_cp, sstride_cs,
                                  W_PAGE, W_PER_BLOCK, W_FP8, RATE, C_PAGE, C_PER_BLOCK, C_FP8, BLOCK_N, WINDOW_TILES,
                                  MODE, TOPK, DOT, PRECISION)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    mask = hm[:, None] & dm[None, :]
    if DIRECT:
        tl.store(out_ptr + (row * H + heads[:, None]) * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * stride_or + split * stride_os + heads[:, None] * D + cols[None, :], out, mask=mask)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + (row * tl.num_programs(2) + split) * H + heads, lse, mask=hm)


def paged_v4_attention(q, window, sinks, scale, sliding_window, positions, compressed=None, indices=None, ratio=None,
                       rows_seq=None, splits: int | None = None):
    """As dayzero.ops.attention_v4_paged.paged_v4_attention (checked by `supports`). splits: programs a row's
    tiles are split over (None: enough for one wave over the SMs, `num_splits`), merged as MLA's are."""
    b, h, d = q.shape
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    mode = 0 if compressed is None else (1 if indices is not None else 2)
    comp = compressed if compressed is not None else window
    topk = indices.shape[1] if mode == 1 else 0
    window_tiles = triton.cdiv(int(sliding_window), BLOCK_N)
    extra = 0
    if mode == 1:
        extra = triton.cdiv(topk, BLOCK_N)
        indices = indices.contiguous()
    most = window_tiles + extra  # the most tiles a row has (HCA: at the tables' width)
    if mode == 2:
        most += triton.cdiv(comp.block_table.shape[1] * comp.block_size // int(ratio), BLOCK_N)
    block_h = 16
    head_blocks = triton.cdiv(h, block_h)
    if splits is None:
        splits = num_splits(most * BLOCK_N, b, head_blocks, BLOCK_N, q.device, MIN_TILES_PER_SPLIT)
    per = triton.cdiv(most, splits)
    dot, precision = operand_dtype(q.dtype)
    ws, wsp, wss, w_fp8 = _scale_args(window)
    cs, csp, css, c_fp8 = _scale_args(comp)
    part, lse = out, out
    if splits > 1:
        part = torch.empty(b, splits, h, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, splits, h, dtype=torch.float32, device=q.device)
    _attention_kernel[(b, head_blocks, splits)](
        q, window.data, ws, window.block_table, sinks, comp.data, cs, comp.block_table,
        indices if mode == 1 else positions, positions, rows_seq if rows_seq is not None else positions, part, lse,
        h, per, float(scale) * 1.4426950408889634,
        window.block_table.stride(0), window.data.stride(0), window.data.stride(1), wsp, wss,
        comp.block_table.stride(0), comp.data.stride(0), comp.data.stride(1), csp, css,
        part.stride(0), part.stride(1) if splits > 1 else 0, D=d,
        WINDOW=int(sliding_window), W_PAGE=window.block_size, W_PER_BLOCK=window.per_block, W_FP8=w_fp8,
        RATE=int(ratio or 1), C_PAGE=comp.block_size, C_PER_BLOCK=comp.per_block, C_FP8=c_fp8, BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(d), BLOCK_N=BLOCK_N, WINDOW_TILES=window_tiles,
        EXTRA_TILES=extra, MODE=mode, TOPK=topk, HAS_SEQ=rows_seq is not None, DIRECT=splits == 1, DOT=dot,
        PRECISION=precision, INTERPRET=interpreting(), MAX_TILES=per if interpreting() else 0, num_warps=8)
    if splits > 1:
        merge_splits(part, lse, out, out.stride(1), out.stride(0))
    return out
