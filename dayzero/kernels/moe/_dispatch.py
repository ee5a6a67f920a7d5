"""Token dispatch for the routed-expert GEMMs: (token, slot) pairs sorted by expert, padded per
expert to the GEMM's BLOCK_M, on the device, with no host synchronisation.

Vocabulary. T tokens, k slots each, S = T*k pairs; pair s = t*k + j is slot j of token t.
The GEMMs work on "padded rows": each expert owns a run of whole blocks of BLOCK_M rows, its pairs
first, then padding. Every size is static (known from T, k, E and BLOCK_M alone):
    max_blocks = S // BLOCK_M + min(E, S)       (sum over experts of ceil(count/BLOCK_M) is at most this)
    max_rows   = max_blocks * BLOCK_M
Outputs (`Dispatch`), all int32 on the device of topk_ids:
    counts       [E]           pairs per expert
    expert_block [E]           first block of each expert (exclusive prefix sum of its block counts)
    block_expert [max_blocks]  expert of each block; E for blocks past the last used one (GEMMs skip them)
    row_pair     [max_rows]    the gather index: pair s held by each padded row, S for padding rows
    pair_row     [S]           the scatter index: padded row of each pair, -1 where the expert id is
                               outside [0, E) (such pairs contribute nothing: checking ids would
                               need a host synchronisation)
Within an expert the order of its pairs is the order in which an atomic counter handed out places,
so it may change from run to run; every row is computed independently of its position, and the
final reduction sums each token's k slots in slot order, so the layer's output does not.

Three launches and one memset: count (atomic histogram), offsets (prefix sums over E, block owners,
padding fill), place (atomic rank within the expert, both indices written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dayzero.kernels import pdl



@dataclass
class Dispatch:
    block_m: int
    num_experts: int
    top_k: int
    counts: torch.Tensor
    expert_block: torch.Tensor
    block_expert: torch.Tensor
    row_pair: torch.Tensor
    pair_row: torch.Tensor

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]

    @property
    def max_rows(self) -> int:
        return self.row_pair.shape[0]


def dispatch_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max_blocks, max_rows) for S pairs over E experts in blocks of block_m rows."""
    max_blocks = num_pairs // block_m + min(num_experts, num_pairs)
    return max_blocks, max_blocks * block_m


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, S, E, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < S
    expert = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32)
    valid = in_range & (expert >= 0) & (expert < E)
    tl.atomic_add(counts_ptr + expert, 1, mask=valid, sem="relaxed")


@triton.jit
def _offsets_kernel(counts_ptr, expert_block_ptr, block_expert_ptr, row_pair_ptr, E, S, max_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program p: the owners of blocks p*BLOCK_B.. and the padding fill of their rows; program 0 also
    stores each expert's first block. Every program recomputes the prefix sum over E (<= a few hundred)."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    tl.store(expert_block_ptr + e, block_end - blocks, mask=(e < E) & (pid == 0))
    # The owner of block b is the number of experts whose blocks all end at or before b
    # (experts without pairs own no block and are counted before the owner); E past the last block.
    owned_before = tl.where(e < E, block_end, 2**30)
    b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    owner = tl.sum((owned_before[None, :] <= b[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + b, owner, mask=b < max_blocks)
    r = pid * BLOCK_B * BLOCK_M + tl.arange(0, BLOCK_B * BLOCK_M)
    tl.store(row_pair_ptr + r, tl.zeros([BLOCK_B * BLOCK_M], tl.int32) + S, mask=r < max_blocks * BLOCK_M)


@triton.jit
def _place_kernel(ids_ptr, cursor_ptr, expert_block_ptr, pair_row_ptr, row_pair_ptr, S, E,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < S
    expert = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32)
    valid = in_range & (expert >= 0) & (expert < E)
    safe = tl.where(valid, expert, 0)
    rank = tl.atomic_add(cursor_ptr + safe, 1, mask=valid, sem="relaxed")
    row = tl.load(expert_block_ptr + safe, mask=valid, other=0) * BLOCK_M + rank
    row = tl.where(valid, row, -1)
    tl.store(pair_row_ptr + offs, row, mask=in_range)
    tl.store(row_pair_ptr + row, offs, mask=valid)


def dispatch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Dispatch:
    """Sort the (token, slot) pairs of topk_ids [T, k] (int32 or int64) by expert; see the module docstring."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dispatch: topk_ids must be int32/int64 [tokens, top_k], got {topk_ids.dtype} "
                         f"with shape {tuple(topk_ids.shape)}")
    if block_m <= 0 or block_m & (block_m - 1):
        raise ValueError(f"dispatch: block_m must be a power of two, got {block_m}")
    ids = topk_ids.contiguous().view(-1)
    S, E, dev = ids.numel(), num_experts, ids.device
    max_blocks, max_rows = dispatch_sizes(S, E, block_m)
    counters = torch.zeros(2, E, dtype=torch.int32, device=dev)  # counts, then the placing cursor
    counts, cursor = counters[0], counters[1]
    expert_block = torch.empty(E, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max(max_blocks, 1), dtype=torch.int32, device=dev)
    row_pair = torch.empty(max(max_rows, 1), dtype=torch.int32, device=dev)
    pair_row = torch.empty(S, dtype=torch.int32, device=dev)
    block = 1024
    if S:
        _count_kernel[(triton.cdiv(S, block),)](ids, counts, S, E, BLOCK=block)
    block_b = 16
    _offsets_kernel[(triton.cdiv(max(max_blocks, 1), block_b),)](
        counts, expert_block, block_expert, row_pair, E, S, max_blocks,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(E), BLOCK_B=block_b)
    if S:
        _place_kernel[(triton.cdiv(S, block),)](ids, cursor, expert_block, pair_row, row_pair, S, E,
                                                BLOCK_M=block_m, BLOCK=block)
    return Dispatch(block_m, E, topk_ids.shape[1], counts, expert_block, block_expert[:max_blocks],
                    row_pair[:max_rows], pair_row)


@dataclass
class BlockList:
    """The blocks one GEMM launch runs, as int32 device tensors of a static length (unused entries have
    expert E, and the GEMM skips them): first padded row, expert, and the end of that expert's padded rows
    (a block may reach past it; the GEMM stores no row there)."""
    row0: torch.Tensor
    expert: torch.Tensor
    end: torch.Tensor

    def __len__(self) -> int:
        return self.row0.shape[0]


@triton.jit
def _split_kernel(counts_ptr, expert_block_ptr, row0_ptr, expert_ptr, end_ptr, E, n_main, n_total,
                  BLOCK_M: tl.constexpr, BIG: tl.constexpr, TAIL_MAX: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    """Entries b < n_main: the big blocks (BIG * BLOCK_M rows); entries from n_main: the tail blocks
    (BLOCK_M rows). Each expert's nb small blocks: nb // BIG big ones, and the rest as one more big
    block when more than TAIL_MAX remain, else as that many tail blocks."""
    e = tl.arange(0, BLOCK_E)
    c = tl.load(counts_ptr + e, mask=e < E, other=0)
    nb = (c + BLOCK_M - 1) // BLOCK_M
    full = nb // BIG
    rem = nb - full * BIG
    big = full + (rem > TAIL_MAX).to(tl.int32)
    tail = tl.where(rem > TAIL_MAX, 0, rem)
    start = tl.load(expert_block_ptr + e, mask=e < E, other=0)
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    is_tail = b >= n_main
    j = tl.where(is_tail, b - n_main, b)
    per = tl.where(is_tail[:, None], tail[None, :], big[None, :])  # [BLOCK_B, BLOCK_E]
    ends = tl.cumsum(per, axis=1)
    owner = tl.sum(((ends <= j[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
    mine = e[None, :] == owner[:, None]
    first = tl.sum(tl.where(mine, ends - per, 0), axis=1)  # the owner's first entry in this list
    ostart = tl.sum(tl.where(mine, start[None, :], 0), axis=1)
    ofull = tl.sum(tl.where(mine, full[None, :], 0), axis=1)
    onb = tl.sum(tl.where(mine, nb[None, :], 0), axis=1)
    blk = tl.where(is_tail, ostart + ofull * BIG + (j - first), ostart + (j - first) * BIG)
    ok = (b < n_total) & (owner < E)
    tl.store(row0_ptr + b, tl.where(ok, blk * BLOCK_M, 0), mask=b < n_total)
    tl.store(expert_ptr + b, tl.where(ok, owner, E), mask=b < n_total)
    tl.store(end_ptr + b, tl.where(ok, (ostart + onb) * BLOCK_M, 0), mask=b < n_total)


def split_blocks(d: Dispatch, big: int, tail_max: int) -> tuple[BlockList, BlockList]:
    """(big blocks, tail blocks) of a dispatch: each expert's blocks of d.block_m rows grouped by `big`
    into blocks of big * block_m rows, and its last nb % big blocks kept as tail blocks when there are
    at most tail_max of them (else one more big block, reaching past the expert's rows). Static lengths:
    S // (big * block_m) + min(E, S) big, tail_max * min(E, S) tail. One launch, no host synchronisation."""
    if big < 1 or not 0 <= tail_max < big:
        raise ValueError(f"split_blocks: need big >= 1 and 0 <= tail_max < big, got {big}, {tail_max}")
    S, E = d.pair_row.shape[0], d.num_experts
    n_main = S // (big * d.block_m) + min(E, S)
    n_tail = tail_max * min(E, S)
    n = max(n_main + n_tail, 1)
    out = torch.empty(3, n, dtype=torch.int32, device=d.counts.device)
    block_b = 16
    _split_kernel[(triton.cdiv(n, block_b),)](d.counts, d.expert_block, out[0], out[1], out[2], E, n_main,
                                             n_main + n_tail, BLOCK_M=d.block_m, BIG=big, TAIL_MAX=tail_max,
                                             BLOCK_E=triton.next_power_of_2(max(E, 1)), BLOCK_B=block_b)
    main = BlockList(out[0, :n_main], out[1, :n_main], out[2, :n_main])
    tail = BlockList(out[0, n_main:n_main + n_tail], out[1, n_main:n_main + n_tail], out[2, n_main:n_main + n_tail])
    return main, tail


@triton.jit
def _combine_kernel(y_ptr, pair_row_ptr, out_ptr, H, stride_y, stride_out,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    pdl.start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pair_row_ptr + t * TOP_K + j)
        y = tl.load(y_ptr + row.to(tl.int64) * stride_y + h, mask=(h < H) & (row >= 0), other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


def combine(y: torch.Tensor, d: Dispatch, num_tokens: int, out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum over j of y[pair_row[t*k + j]] (float32 sum in slot order, deterministic) -> [T, H].
    y: [max_rows, H], each row already multiplied by its pair's router weight."""
    H = y.shape[1]
    out = torch.empty(num_tokens, H, dtype=out_dtype, device=y.device)
    if num_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(num_tokens, triton.cdiv(H, block_h))](y, d.pair_row, out, H, y.stride(0), out.stride(0),
                                                            TOP_K=d.top_k, BLOCK_H=block_h,
                                                            **pdl.launch_options(y.device))
    return out


def dispatch_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Dispatch:
    """The same dispatch in plain PyTorch (stable order within each expert); a test oracle."""
    ids = topk_ids.reshape(-1).long()
    S, E, dev = ids.numel(), num_experts, ids.device
    max_blocks, max_rows = dispatch_sizes(S, E, block_m)
    valid = (ids >= 0) & (ids < E)
    key = torch.where(valid, ids, E)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    expert_block = block_end - blocks
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=dev), right=True)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(S, device=dev) - first[sorted_key.clamp(max=E - 1)]
    rows = expert_block[sorted_key.clamp(max=E - 1)] * block_m + rank
    pair_row = torch.full((S,), -1, dtype=torch.long, device=dev)
    pair_row[order] = torch.where(sorted_key < E, rows, -1)
    row_pair = torch.full((max_rows,), S, dtype=torch.long, device=dev)
    row_pair[pair_row[valid]] = torch.arange(S, device=dev)[valid]
    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    return Dispatch(block_m, E, topk_ids.shape[1], i32(counts), i32(expert_block), i32(block_expert),
                    i32(row_pair), i32(pair_row))
