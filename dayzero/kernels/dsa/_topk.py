"""The k largest of each row of int64 order keys (dayzero/kernels/dsa/_index.py: distinct visible keys,
INT64_MIN for keys not visible), by radix select over many programs per row, where torch.topk selects a
row in one thread block (a decode at 128K is one row).

The keys' high 32 bits are the score's sortable bits; u = high + 2^31 orders them as unsigned values in
[1, 2^32) (0 only for INT64_MIN, never visible). Three rounds find the score threshold T and how many keys
of score T to take (`need`): each round histograms one digit of u (11, 11, 10 bits) over the keys whose
higher digits are the threshold's so far (a program histograms its segment of the row and adds it to the
row's histogram), then one program per row walks its histogram from the top to the digit where the
count reaches `need`. A row with fewer than k visible keys takes them all. Then every key of score > T
is taken, and of the keys of score T the first `need` by position (their low 32 bits decrease with the
position, so in key order they come best first too): a count per segment and its exclusive prefix sum
give each program the rank of its first key of score T. The taken keys (k, or all visible; the rest
INT64_MIN) are then sorted, descending: torch.topk's values, exactly (the keys are distinct).

Launches: 3 histograms, 3 walks, a count, a prefix sum, the selection, a sort of [rows, k]; every
size from the host, no host synchronisation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # keys a program reads at a time
TILES = 4  # blocks a program reads: its segment of the row
ROUNDS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of u's digits, highest first
INT64_MIN = -2**63
LOW = 2**31 - 1  # an order key's low 32 bits are LOW - position (dsa/_index.py's _order_key)
KEY_MIN = tl.constexpr(INT64_MIN)  # the same, for the kernels


@triton.jit
def _u(key):
    """The score part of a key as an int64 in [0, 2^32): 0 for INT64_MIN, unsigned order = score order."""
    return (key >> 32) + 2147483648


@triton.jit
def _width(len_ptr, r, W, HAS_LEN: tl.constexpr):
    """The columns of row r that may hold visible keys: all W, or the row's length (the rest unread)."""
    if HAS_LEN:
        return tl.minimum(tl.load(len_ptr + r), W)
    return W


@triton.jit
def _hist_kernel(keys_ptr, stride_r, W, len_ptr, prefix_ptr, need_ptr, hist_ptr, SHIFT: tl.constexpr,
                 BITS: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, HAS_LEN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    width = _width(len_ptr, r, W, HAS_LEN)
    NB: tl.constexpr = 1 << BITS
    prefix = tl.load(prefix_ptr + r)
    live = tl.load(need_ptr + r) > 0  # a row taking all its visible keys is decided
    counts = tl.zeros([NB], dtype=tl.int32)
    for i in tl.static_range(TILES):
        cols = (seg * TILES + i) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + r * stride_r + cols, mask=cols < width, other=KEY_MIN)
        u = _u(key)
        ok = (u > 0) & ((u >> (SHIFT + BITS)) == prefix) & live
        counts += tl.histogram(((u >> SHIFT) & (NB - 1)).to(tl.int32), NB, mask=ok)
    tl.atomic_add(hist_ptr + r * NB + tl.arange(0, NB), counts)


@triton.jit
def _walk_kernel(hist_ptr, prefix_ptr, need_ptr, BITS: tl.constexpr):
    """From the highest digit down: the digit where the row's count reaches `need`; prefix and need
    become the threshold's digits so far and the keys still to take among those sharing them."""
    r = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = 1 << BITS
    need = tl.load(need_ptr + r)
    down = tl.arange(0, NB)
    h = tl.load(hist_ptr + r * NB + (NB - 1 - down))  # h[i]: the count of digit NB - 1 - i
    c = tl.cumsum(h, 0)
    idx = tl.min(tl.where(c >= need, down, NB), 0)
    above = tl.sum(tl.where(down < idx, h, 0), 0)
    prefix = tl.load(prefix_ptr + r)
    if need > 0:
        if idx < NB:
            tl.store(prefix_ptr + r, (prefix << BITS) | (NB - 1 - idx))
            tl.store(need_ptr + r, need - above)
        else:  # fewer than k visible keys (only in the first round): take them all
            tl.store(prefix_ptr + r, 0)
            tl.store(need_ptr + r, -1)
    else:
        tl.store(prefix_ptr + r, prefix << BITS)


@triton.jit
def _count_kernel(keys_ptr, stride_r, W, len_ptr, prefix_ptr, eq_ptr, SEGS, BLOCK: tl.constexpr,
                  TILES: tl.constexpr, HAS_LEN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    width = _width(len_ptr, r, W, HAS_LEN)
    t = tl.load(prefix_ptr + r)
    n = 0
    for i in tl.static_range(TILES):
        cols = (seg * TILES + i) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + r * stride_r + cols, mask=cols < width, other=KEY_MIN)
        n += tl.sum(((_u(key) == t) & (key != KEY_MIN)).to(tl.int32), 0)
    tl.store(eq_ptr + r * SEGS + seg, n)


@triton.jit
def _select_kernel(keys_ptr, stride_r, W, len_ptr, prefix_ptr, need_ptr, eq_ptr, taken_ptr, out_ptr, SEGS, K,
                   BLOCK: tl.constexpr, TILES: tl.constexpr, HAS_LEN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    width = _width(len_ptr, r, W, HAS_LEN)
    t = tl.load(prefix_ptr + r)
    need = tl.load(need_ptr + r)
    take_all = need < 0
    exact = need >= 0
    need = tl.maximum(need, 0)
    rank = tl.load(eq_ptr + r * SEGS + seg)  # keys of score T in the segments before this one
    for i in tl.static_range(TILES):
        cols = (seg * TILES + i) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + r * stride_r + cols, mask=cols < width, other=KEY_MIN)
        u = _u(key)
        visible = key != KEY_MIN
        above = visible & ((u > t) | take_all)
        equal = visible & (u == t) & exact
        n_above = tl.sum(above.to(tl.int32), 0)
        base = tl.atomic_add(taken_ptr + r, n_above)
        slot = base + tl.cumsum(above.to(tl.int32), 0) - 1
        tl.store(out_ptr + r * K + slot, key, mask=above)
        ranks = rank + tl.cumsum(equal.to(tl.int32), 0) - 1
        keep = equal & (ranks < need)
        tl.store(out_ptr + r * K + (K - need) + ranks, key, mask=keep)
        rank += tl.sum(equal.to(tl.int32), 0)


def topk_keys(keys: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """keys int64 [R, W] (distinct, or INT64_MIN) -> their min(k, W) largest per row, descending: what
    torch.topk(keys, min(k, W), dim=1).values gives. lengths: optional int32 [R] on the device, row r's
    keys past lengths[r] are INT64_MIN and not read (a CUDA graph's rows are max_model_len wide, its
    sequences mostly shorter)."""
    r, w = keys.shape
    k = min(k, w)
    device = keys.device
    segs = triton.cdiv(w, BLOCK * TILES)
    lens = keys if lengths is None else lengths  # any pointer when unused
    prefix = torch.zeros(r, dtype=torch.int64, device=device)
    need = torch.full((r,), k, dtype=torch.int64, device=device)
    hist = torch.zeros(r * sum(1 << b for _, b in ROUNDS), dtype=torch.int32, device=device)
    offset = 0
    for shift, bits in ROUNDS:
        h = hist[offset:offset + (r << bits)]  # [r, 2^bits], contiguous
        offset += r << bits
        _hist_kernel[(r, segs)](keys, keys.stride(0), w, lens, prefix, need, h, SHIFT=shift, BITS=bits, BLOCK=BLOCK,
                                TILES=TILES, HAS_LEN=lengths is not None, num_warps=8)  # 8 warps: 128 registers a thread at 11 bits, no spills
        _walk_kernel[(r,)](h, prefix, need, BITS=bits, num_warps=4)
    eq = torch.empty(r, segs, dtype=torch.int32, device=device)
    _count_kernel[(r, segs)](keys, keys.stride(0), w, lens, prefix, eq, segs, BLOCK=BLOCK, TILES=TILES,
                             HAS_LEN=lengths is not None, num_warps=4)
    eq = (torch.cumsum(eq, dim=1, dtype=torch.int32) - eq).contiguous()  # exclusive: the ranks before each segment
    taken = torch.zeros(r, dtype=torch.int32, device=device)
    out = torch.full((r, k), INT64_MIN, dtype=torch.int64, device=device)
    _select_kernel[(r, segs)](keys, keys.stride(0), w, lens, prefix, need, eq, taken, out, segs, k, BLOCK=BLOCK,
                              TILES=TILES, HAS_LEN=lengths is not None, num_warps=4)
    return torch.sort(out, dim=1, descending=True).values


def best_positions(keys: torch.Tensor, k: int, radix: bool, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The columns (positions) of each row's min(k, W) largest order keys, best first, -1 for keys not
    visible: by the radix select (lengths as in `topk_keys`) or torch.topk. int64 [R, min(k, W)]."""
    if radix:
        top = topk_keys(keys, k, lengths)
    else:
        top = torch.topk(keys, min(k, keys.shape[1]), dim=1, sorted=True).values  # distinct keys: exact order
    return (LOW - (top & 0xFFFFFFFF)).masked_fill_(top == INT64_MIN, -1)
