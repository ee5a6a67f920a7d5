"""Routed-expert layer for decode steps (few rows per expert), MXFP4 weights: integer dot products on
the CUDA cores instead of tensor-core MMAs, so that the weights are decoded once, in registers, with
a few integer instructions per code, and never travel through shared memory.

At 1 to 32 tokens an active expert sees 1 to a few rows, so an MMA tile (64 weight rows x 16 rows) is
mostly padding and the layer is bound by the work of unpacking weights, not by arithmetic. Here:

- Activations are quantized per row and per 32 values of K (the MXFP4 block) to 16-bit integers
  q = round(v * 2^(140 - E)) with E the float32 exponent field of the block's largest |v| (so
  |q| <= 2^14: exact for every value within 2^6 of the block maximum, absolute error at most 2^-14 of
  it otherwise, finer than bf16), split into a signed high byte and an unsigned low byte
  (q = 256 * hi + lo). The factor back, 2^(E - 141), folds in the 1/2 of the weight bytes below.
- Each E2M1 code becomes the unsigned byte 2 * value + 24 (12..36) with two byte permutes (PRMT) per
  four codes and one OR, the codes themselves as PRMT's selectors (nine integer instructions per word
  of eight codes; see _E2M1_BYTES_ASM). `dp4a` (four byte x byte products plus an int32 addend)
  multiplies them with the activation bytes; the offset comes back out as 24 times the block's
  activation sum, stored by the quantizer beside the block factor as the int32 that starts the
  block's low-byte dp4a chain. A 32-value block's integer sum (< 2^24, exact in float32) is scaled by
  the activation factor and the block's E8M0 factor 2^(s - 127) (NaN for 0xFF; one shift where the
  caller knows every byte lies in 1..254, NORMAL_SCALES), both powers of two, so every block's
  contribution is exact and only the float32 sum over blocks rounds.
- A program owns one dispatch block (BLOCK_M <= 4 padded rows of one expert) and BLOCK_N outputs; the
  weights of a K tile are decoded once and used for every valid row of the block (rows past the
  expert's count are skipped at run time). Tiles are read unmasked (a last partial K tile is read
  from K - BLOCK_K, its repeated blocks get activation factor 0) and either prefetched two steps ahead
  in registers (STAGES = 0) or staged through shared memory by Triton's software pipeline (STAGES >= 2). The
  gate/up GEMM applies biases and the activation and writes the intermediate h already quantized for
  the down GEMM, which applies its bias and the router weight and writes float32 rows for the final
  k-slot reduction (moe_dispatch.combine), so a token's sum is rounded to bf16 once.
- The layer is four launches, with no host synchronisation: `prep` (the dispatch of up to 512 pairs
  in one program, without atomics, and the quantization of x in the others), the two GEMMs, combine;
  on sm_90 each launched with programmatic dependent launch (kernels/pdl.py), so that the next one's
  launch and ramp-up overlap the previous one's tail.
- Split-K (DecodeConfig.split_k1/2; for one token where DAYZERO_MOE_DECODE_SPLITK=1): where a GEMM
  has too few programs to keep the SMs busy, K is cut into chunks of whole tiles, one program each,
  which write float32 partial sums [chunks, max_rows, width]. For gate/up a fifth launch
  (activate_partials) adds the chunks, biases and activation and quantizes h; for down,
  combine_partials adds chunks and k slots in place of combine. No atomics: every sum runs in a fixed
  order, so results are deterministic (they differ from the unsplit kernels by float32 rounding).

Where this stands on the H200 (docs/kernels.md has the numbers): 2-3x faster than the tensor-core
kernel at 1-32 tokens; 48-62% of copy bandwidth at one token (8 layers per CUDA graph, where a pure
read of the same bytes reaches 91-95%), 65-89% at 8-32 tokens. On sm_90 the one-token layer runs both
GEMMs as moe_decode_sm90's Gluon kernels instead (DecodeConfig.gluon1/gluon2, GLUON_ONE_TOKEN: the same
arithmetic with the data movement written out; 1.14-1.20x, 58-68% of copy bandwidth). At one token the down GEMM loads its
first weight tiles before it waits for the gate/up GEMM (DecodeConfig.early2), 7-18% faster. Bound by
latency and by issued instructions about equally: the offset bytes cut the integer work per weight
word from 16 to 9 instructions and gained 0-11%; the pipelined loop (STAGES >= 2: tiles through shared
memory, fewer registers, more programs in flight) gained 10-25% at 8-128 tokens and, with 8-warp
32 x 512 tiles, 10-14% at one token; removing the scale path's instructions (a measurement, wrong
results) would gain 10-13%, its one-shift factors gained 1-5%, hiding its load latency nothing.
Biases and router weights are loaded before the K loop (the bias into the accumulator), not in the
epilogue, where their latency stalled every program (1-4% on gpt-oss-120b).

Layouts (all contiguous):
    xq   int32 [R, 4, K/8]   quantized activation rows; word g of plane p holds 4 bytes for
                             k = 8g + 4*(p % 2) .. +3: planes 0, 1 the high bytes, 2, 3 the low bytes
    xs   float32 [R, 2, K/32] plane 0: the factor 2^(E - 141) of each 32-value block (NaN if it held a
                             non-finite); plane 1: the bits of the int32 -24 * the block's sum of q (the
                             weight bytes' offset, the start of the block's integer dot product)
    w    int32 [E, N, K/8]   MXFP4 codes (canonical layout, 8 per word, code k = 8g+i in bits 4i..4i+3)
    s    uint8 [E, N, K/32]  E8M0 scales

Under Triton's interpreter (the CPU tests) PRMT and dp4a are computed by their definition in integer
tensor ops; everything else is the compiled code.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dayzero.kernels import pdl
from dayzero.kernels.moe_gemm import _activate, interpreting, kernel_activation


@dataclass(frozen=True)
class DecodeConfig:
    """block_m: padded rows per dispatch block (1, 2 or 4). Per GEMM (1: gate/up, 2: down): block_n,
    outputs per program (gate/up: intermediate columns, a multiple of 32); block_k, K per loop step (a
    power of two >= 32, capped at K); num_warps; split_k, K chunks per output tile, one program each
    (1: none; see decode_gemm); stages: 0 = weight tiles prefetched by hand two steps ahead in
    registers, n >= 2 = Triton's software pipeline with n stages (tiles copied asynchronously into
    shared memory: fewer registers per thread, more programs and more bytes in flight per SM).

    pair_order (block_m 1 only): dispatch block b is pair b, unsorted, and each GEMM reads its expert
    straight from topk_ids (written by the router, before prep), so the gate/up GEMM knows its weights
    before prep has finished. early1 / early2 (stages 0 only): the hand prefetch's first two weight tiles
    are loaded before the GEMM waits for the launch before it (PDL; see _moe_decode_kernel), so they
    stream in while that launch finishes. early1 needs pair_order.

    gluon1 / gluon2 (pair_order, no split): the gate/up / down GEMM runs moe_decode_sm90's Gluon kernel
    (sm_90 only; the caller checks moe_decode_sm90.available) with that GEMM's tile; its stages n >= 2
    keep n - 1 weight tiles in flight, the first n - 1 requested before the PDL wait: in registers, or with
    smem1 / smem2 copied asynchronously into a ring of n shared-memory slots."""
    block_m: int
    block_n1: int
    block_n2: int
    block_k1: int = 256
    block_k2: int = 256
    num_warps1: int = 4
    num_warps2: int = 4
    split_k1: int = 1
    split_k2: int = 1
    stages1: int = 0
    stages2: int = 0
    pair_order: bool = False
    early1: bool = False
    early2: bool = False
    gluon1: bool = False
    gluon2: bool = False
    smem1: bool = False
    smem2: bool = False

    def __post_init__(self):
        if self.pair_order and self.block_m != 1:
            raise ValueError(f"DecodeConfig: pair_order needs block_m 1, got {self.block_m}")
        if self.early1 and not self.pair_order:
            raise ValueError("DecodeConfig: early1 needs pair_order (the gate/up GEMM must know its experts "
                             "before prep, the launch before it, has finished)")
        for g, split, stages, early in ((self.gluon1, self.split_k1, self.stages1, self.early1),
                                        (self.gluon2, self.split_k2, self.stages2, self.early2)):
            if g and (not self.pair_order or split > 1 or stages < 2 or early):
                raise ValueError("DecodeConfig: a Gluon GEMM (gluon1/gluon2) needs pair_order, no split K, "
                                 f"stages >= 2 and no early flag, got pair_order {self.pair_order}, split {split}, "
                                 f"stages {stages}, early {early}")
        if (self.early1 and self.stages1) or (self.early2 and self.stages2):
            raise ValueError("DecodeConfig: early1/early2 load the hand prefetch's tiles early: they need stages 0, "
                             f"got stages {self.stages1}, {self.stages2}")


# Eight E2M1 codes (one word) -> two words of four unsigned bytes 2 * value + 24 (12..36), two byte
# permutes per four codes: PRMT's selector nibble is the code itself, whose sign bit (bit 3) asks PRMT
# for the sign of the selected byte instead of the byte. A positive code picks 24 + 2|v| from table A
# ($3, $4); a negative one gets 0 there (table bytes are < 128). With the sign bits flipped the roles
# swap: a negative code picks 24 - 2|v| from table B ($5, $6), a positive one 0. The OR of the two is
# the offset byte; the dot product subtracts 24 * (the activation block's sum), see quantize_rows.
_E2M1_BYTES_ASM = tl.constexpr("""{
.reg .b32 x, p, q, h;
xor.b32 x, $2, 0x88888888;
prmt.b32 p, $3, $4, $2;
prmt.b32 q, $5, $6, x;
or.b32 $0, p, q;
shr.u32 h, $2, 16;
shr.u32 x, x, 16;
prmt.b32 p, $3, $4, h;
prmt.b32 q, $5, $6, x;
or.b32 $1, p, q;
}""")
WEIGHT_OFFSET = tl.constexpr(24)  # added to each weight byte 2 * value, so that every byte is unsigned


@triton.jit
def _e2m1_bytes_by_definition(words, SHIFT: tl.constexpr):
    """Codes SHIFT/4 .. SHIFT/4 + 3 of each word (a 3-d tensor) as four unsigned bytes 2 * e2m1 + 24:
    what the PRMTs give."""
    i = tl.arange(0, 4)[None, None, None, :]
    code = (words[:, :, :, None] >> (SHIFT + 4 * i)) & 0xF
    mag = code & 7
    twice = tl.where(mag < 4, mag, (2 + (mag & 1)) << tl.maximum((mag >> 1) - 1, 0))
    twice = tl.where(code >= 8, -twice, twice) + WEIGHT_OFFSET
    return tl.sum(twice << (8 * i), axis=3)  # disjoint bytes: the sum is their bitwise or


@triton.jit
def _e2m1_bytes(words, zero, USE_ASM: tl.constexpr):
    """int32 words of 8 E2M1 codes -> (codes 0..3, codes 4..7), each as four unsigned bytes 2 * value + 24."""
    if USE_ASM:
        # The tables as bytes 0..7 of two words: 24 + {0,1,2,3 | 4,6,8,12} and 24 - the same. `zero`
        # keeps them in registers (see _moe_decode_kernel).
        tables = [zero + 0x1B1A1918, zero + 0x24201E1C, zero + 0x15161718, zero + 0x0C101214]
        lo, hi = tl.inline_asm_elementwise(_E2M1_BYTES_ASM, "=r,=r,r,r,r,r,r", [words] + tables,
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = _e2m1_bytes_by_definition(words, 0)
        hi = _e2m1_bytes_by_definition(words, 16)
    return lo, hi


@triton.jit
def _bytes(v, SIGNED: tl.constexpr):
    """The four bytes of each int32 of a 3-d tensor, [.., 4], sign-extended or not."""
    shift = (24 - 8 * tl.arange(0, 4))[None, None, None, :]
    if SIGNED:
        return (v[:, :, :, None] << shift) >> 24
    else:
        return (v[:, :, :, None] >> (24 - shift)) & 0xFF


@triton.jit
def _e8m0_factor(scale, NORMAL: tl.constexpr = False):
    """E8M0 bytes -> float32 2^(s - 127): s = 0 is the subnormal 2^-127, s = 0xFF NaN. NORMAL: the
    caller knows every byte lies in 1..254, where the float32 with exponent field s is exact (one
    shift instead of five instructions per byte)."""
    s = scale.to(tl.int32)
    if NORMAL:
        return (s << 23).to(tl.float32, bitcast=True)
    bits = tl.where(s == 0, 0x00400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_store(v, q_ptr, s_ptr, n0, N: tl.constexpr, BLOCK: tl.constexpr):
    """Quantize float32 v [BLOCK] (columns n0.. of one row) per 32 values into the xq/xs layout of the
    module docstring; q_ptr/s_ptr point at the row. Columns past N are not stored (BLOCK % 32 == 0)."""
    NB: tl.constexpr = BLOCK // 32
    vb = tl.reshape(v, [NB, 32])
    amax = tl.max(tl.abs(vb), axis=1)
    e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 20)  # float32 exponent field of amax
    factor = ((267 - e) << 23).to(tl.float32, bitcast=True)  # 2^(140 - e): |v| * factor < 2^14
    back = ((e - 14) << 23).to(tl.float32, bitcast=True)  # 2^(e - 141)
    finite = tl.sum((tl.abs(vb) < float("inf")).to(tl.int32), axis=1) == 32
    back = tl.where(finite, back, float("nan"))  # a NaN or infinity in the block makes its products NaN
    scaled = vb * factor[:, None]
    q = (scaled + tl.where(scaled < 0, -0.5, 0.5)).to(tl.int32)  # round half away from zero
    q = tl.where(scaled == scaled, q, 0)
    q = tl.reshape(q, [NB, 4, 2, 4])  # [block, word, half, byte]: k = 32*block + 8*word + 4*half + byte
    shift = 8 * tl.arange(0, 4)[None, None, None, :]
    hi = tl.sum(((q >> 8) & 0xFF) << shift, axis=3)  # [NB, 4, 2]
    lo = tl.sum((q & 0xFF) << shift, axis=3)
    blk = n0 // 32 + tl.arange(0, NB)
    word = (blk * 4)[:, None, None] + tl.arange(0, 4)[None, :, None]
    plane = tl.arange(0, 2)[None, None, :] * (N // 8)
    mask = (blk < N // 32)[:, None, None]
    tl.store(q_ptr + plane + word, hi, mask=mask)
    tl.store(q_ptr + 2 * (N // 8) + plane + word, lo, mask=mask)
    tl.store(s_ptr + blk, back, mask=blk < N // 32)
    qsum = tl.sum(tl.sum(tl.sum(q, axis=3), axis=2), axis=1)  # |24 * qsum| <= 24 * 32 * 2^14 < 2^24
    tl.store(s_ptr + N // 32 + blk, (-qsum * WEIGHT_OFFSET).to(tl.float32, bitcast=True), mask=blk < N // 32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK
    offs = n0 + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row.to(tl.int64) * K + offs, mask=offs < K, other=0.0).to(tl.float32)
    _quantize_store(v, q_ptr + row.to(tl.int64) * (K // 2), s_ptr + row.to(tl.int64) * (K // 16), n0, K, BLOCK)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (any float dtype, K % 32 == 0) -> (xq int32 [R, 4, K/8], xs float32 [R, 2, K/32])."""
    R, K = x.shape
    xq = torch.empty(R, 4, K // 8, dtype=torch.int32, device=x.device)
    xs = torch.empty(R, 2, K // 32, dtype=torch.float32, device=x.device)
    if R:
        block = min(1024, triton.next_power_of_2(K))
        _quantize_rows_kernel[(R, triton.cdiv(K, block))](x, xq, xs, K=K, BLOCK=block)
    return xq, xs


def dequantize_rows(xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """The float32 rows that quantize_rows' output stands for (a test oracle)."""
    R, _, words = xq.shape
    b = xq.contiguous().view(torch.uint8).view(R, 4, words, 4).long()  # little-endian bytes
    hi = torch.where(b[:, :2] >= 128, b[:, :2] - 256, b[:, :2])
    q = hi * 256 + b[:, 2:]  # [R, 2 (half), words, 4]
    q = q.permute(0, 2, 1, 3).reshape(R, words * 8)
    return q.float() * (2 * xs[:, 0]).repeat_interleave(32, dim=1)


@triton.jit
def _last_run_start(f1, l1, s1, f2, l2, s2):
    """associative_scan's combine over two adjacent spans of a sorted sequence, each (first value, last
    value, where its last run of equal values starts): the right span's run continues the left's when
    the right span is one run (first == last, the sequence being sorted) of the left's last value."""
    return f1, l2, tl.where((f2 == l2) & (l1 == f2), s1, s2)


@triton.jit
def _prep_kernel(ids_ptr, x_ptr, xq_ptr, xs_ptr, block_expert_ptr, row_pair_ptr, pair_row_ptr, S, E, max_blocks,
                 max_rows, K: tl.constexpr, QBLOCK: tl.constexpr, NQ: tl.constexpr, BLOCK_M: tl.constexpr,
                 BS: tl.constexpr, BR: tl.constexpr, NR: tl.constexpr, NB: tl.constexpr,
                 PDL: tl.constexpr, PAIR_ORDER: tl.constexpr = False):
    """Program 0: the dispatch of S <= BS pairs (moe_dispatch's layout, pairs of an expert in pair
    order, no atomics); programs 1..: quantize x, QBLOCK columns of one row each. The pairs are sorted by
    (expert, pair); a pair's rank within its expert is its distance from the start of its expert's run
    (a segmented scan), a pair of rank divisible by BLOCK_M opens a block, and a pair's block is the
    number of opening pairs up to it, minus one. PAIR_ORDER (BLOCK_M 1): block s is pair s, row s its
    row (S blocks and rows)."""
    pdl.start(PDL)
    pid = tl.program_id(0)
    if pid > 0:
        row = (pid - 1) // NQ
        n0 = ((pid - 1) % NQ) * QBLOCK
        offs = n0 + tl.arange(0, QBLOCK)
        v = tl.load(x_ptr + row.to(tl.int64) * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        _quantize_store(v, xq_ptr + row.to(tl.int64) * (K // 2), xs_ptr + row.to(tl.int64) * (K // 16), n0, K,
                        QBLOCK)
    elif PAIR_ORDER:
        s = tl.arange(0, BS)
        ids = tl.load(ids_ptr + s, mask=s < S, other=-1)
        valid = (s < S) & (ids >= 0) & (ids < E)
        tl.store(block_expert_ptr + s, tl.where(valid, ids.to(tl.int32), E), mask=s < S)
        tl.store(row_pair_ptr + s, tl.where(valid, s, S), mask=s < S)
        tl.store(pair_row_ptr + s, tl.where(valid, s, -1), mask=s < S)
    else:
        s = tl.arange(0, BS)
        ids = tl.load(ids_ptr + s, mask=s < S, other=-1).to(tl.int32)
        valid = (s < S) & (ids >= 0) & (ids < E)
        # The pairs sorted by (expert, pair); invalid ones and the padding past S sort last, as expert E.
        sk = tl.sort(tl.where(valid, ids, E) * BS + s)
        e = sk // BS
        src = sk % BS  # the pair at sorted position i
        i = tl.arange(0, BS)
        _, _, start = tl.associative_scan((e, e, i), 0, _last_run_start)
        rank = i - start  # rank within its expert: earlier pairs of that expert come first
        ok = e < E
        opens = ok & (rank % BLOCK_M == 0)
        block = tl.cumsum(opens.to(tl.int32), 0) - 1  # its expert's blocks follow the lower experts' ones
        prow = block * BLOCK_M + rank % BLOCK_M
        tl.store(pair_row_ptr + src, tl.where(ok, prow, -1), mask=src < S)
        for r0 in tl.static_range(0, NR * BR, BR):
            r = r0 + tl.arange(0, BR)
            tl.store(row_pair_ptr + r, tl.zeros([BR], tl.int32) + S, mask=r < max_rows)
        for b0 in tl.static_range(0, NB * BR, BR):
            b = b0 + tl.arange(0, BR)
            tl.store(block_expert_ptr + b, tl.zeros([BR], tl.int32) + E, mask=b < max_blocks)
        tl.debug_barrier()
        tl.store(row_pair_ptr + prow, src, mask=ok)
        tl.store(block_expert_ptr + block, e, mask=opens)


PREP_MAX_PAIRS = 512


def prep(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, block_m: int, pair_order: bool = False):
    """(Dispatch, xq, xs) in one launch for at most PREP_MAX_PAIRS pairs: moe_dispatch.dispatch's
    block_expert/row_pair/pair_row (pairs of an expert in pair order; counts and expert_block are not
    computed: None) and quantize_rows(x). pair_order (block_m 1): unsorted, block = row = pair (ids
    outside [0, E) give an empty block), S blocks."""
    from dayzero.kernels.moe_dispatch import Dispatch, dispatch_sizes

    T, H = x.shape
    ids = topk_ids.contiguous().view(-1)
    S = ids.numel()
    if S > PREP_MAX_PAIRS or block_m & (block_m - 1):
        raise ValueError(f"prep: at most {PREP_MAX_PAIRS} pairs and a power-of-two block_m, got {S}, {block_m}")
    if pair_order and block_m != 1:
        raise ValueError(f"prep: pair_order needs block_m 1, got {block_m}")
    max_blocks, max_rows = (S, S) if pair_order else dispatch_sizes(S, num_experts, block_m)
    dev = x.device
    block_expert = torch.empty(max(max_blocks, 1), dtype=torch.int32, device=dev)
    row_pair = torch.empty(max(max_rows, 1), dtype=torch.int32, device=dev)
    pair_row = torch.empty(max(S, 1), dtype=torch.int32, device=dev)
    xq = torch.empty(T, 4, H // 8, dtype=torch.int32, device=dev)
    xs = torch.empty(T, 2, H // 32, dtype=torch.float32, device=dev)
    qblock = min(1024, triton.next_power_of_2(H))
    nq = triton.cdiv(H, qblock)
    bs = max(16, triton.next_power_of_2(S))
    _prep_kernel[(1 + T * nq,)](ids, x, xq, xs, block_expert, row_pair, pair_row, S, num_experts, max_blocks,
                                max_rows, K=H, QBLOCK=qblock, NQ=nq, BLOCK_M=block_m, BS=bs,
                                BR=1024, NR=triton.cdiv(max_rows, 1024), NB=triton.cdiv(max_blocks, 1024),
                                PAIR_ORDER=pair_order, num_warps=8, **pdl.launch_options(dev))
    d = Dispatch(block_m, num_experts, topk_ids.shape[1], None, None, block_expert[:max_blocks], row_pair[:max_rows],
                 pair_row[:S])
    return d, xq, xs


@triton.jit
def _tile_start(k0, kend, BLOCK_K: tl.constexpr):
    """Where the K tile of step k0 is read from: k0, or kend - BLOCK_K for a last partial tile (and for
    the prefetches past the end), so that every load is in bounds and unmasked; the blocks read twice
    get activation factor 0 (_load_row). kend: K, or the end of a split-K program's K chunk (a chunk
    that ends before K is a whole number of tiles). Needs K >= BLOCK_K."""
    return tl.minimum(k0, kend - BLOCK_K)


@triton.jit
def _load_words(w_base, s_base, n0, k0, kend, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 words [BLOCK_N, BLOCK_K/32, 4] and E8M0 bytes [BLOCK_N, BLOCK_K/32] of rows n0.. for the
    K tile of step k0 (see _tile_start)."""
    KB: tl.constexpr = BLOCK_K // 32
    start = _tile_start(k0, kend, BLOCK_K)
    word = start // 8 + tl.arange(0, BLOCK_K // 8)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    words = tl.load(w_base + offs_n[:, None] * (K // 8) + word[None, :])  # 2-d: a warp reads whole rows
    # The scale bytes as a flat [BLOCK_N * KB] load, one byte per thread in row-major order, which is
    # how the words' layout holds the 32-value blocks; the select hides the contiguity of kb from the
    # compiler, which would otherwise vectorize the bytes into another layout.
    i = tl.arange(0, BLOCK_N * KB)
    kb = tl.where(i < 0, 0, i % KB)
    scale = tl.load(s_base + (n0 + i // KB) * (K // 32) + start // 32 + kb)
    return tl.reshape(words, [BLOCK_N, KB, 4]), tl.reshape(scale, [BLOCK_N, KB])


@triton.jit
def _load_row(xq_ptr, xs_ptr, a_row, k0, kend, valid, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The four byte planes [1, BLOCK_K/32, 4], the block factors [BLOCK_K/32] and the blocks' weight
    offset corrections (int32 -24 * the block's sum) of activation row a_row for the K tile of step k0 (see
    _tile_start): factor 0 for blocks before k0 (read twice) and where not valid. The planes are loaded
    2-d with the contiguity of the weight words, so that they
    land in the words' register layout and broadcast over N for free."""
    KB: tl.constexpr = BLOCK_K // 32
    start = _tile_start(k0, kend, BLOCK_K)
    word = start // 8 + tl.arange(0, BLOCK_K // 8)
    ptrs = xq_ptr + a_row.to(tl.int64) * (K // 2) + word[None, :]
    h0 = tl.reshape(tl.load(ptrs, mask=valid, other=0), [1, KB, 4])
    h1 = tl.reshape(tl.load(ptrs + K // 8, mask=valid, other=0), [1, KB, 4])
    l0 = tl.reshape(tl.load(ptrs + 2 * (K // 8), mask=valid, other=0), [1, KB, 4])
    l1 = tl.reshape(tl.load(ptrs + 3 * (K // 8), mask=valid, other=0), [1, KB, 4])
    blk = start // 32 + tl.arange(0, KB)
    xs_row = xs_ptr + a_row.to(tl.int64) * (K // 16) + blk
    xs = tl.load(xs_row, mask=(blk >= k0 // 32) & valid, other=0.0)
    xc = tl.load(xs_row + K // 32, mask=valid, other=0.0).to(tl.int32, bitcast=True)
    return h0, h1, l0, l1, xs, xc


@triton.jit
def _load_rows(xq_ptr, xs_ptr, a0, a1, a2, a3, k0, kend, nrows, K: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """_load_row for the (up to 4) rows of a block; rows past BLOCK_M are copies of row 0, never read."""
    x0 = _load_row(xq_ptr, xs_ptr, a0, k0, kend, True, K, BLOCK_K)
    x1, x2, x3 = x0, x0, x0
    if BLOCK_M > 1:
        x1 = _load_row(xq_ptr, xs_ptr, a1, k0, kend, nrows > 1, K, BLOCK_K)
    if BLOCK_M > 2:
        x2 = _load_row(xq_ptr, xs_ptr, a2, k0, kend, nrows > 2, K, BLOCK_K)
        x3 = _load_row(xq_ptr, xs_ptr, a3, k0, kend, nrows > 3, K, BLOCK_K)
    return x0, x1, x2, x3


@triton.jit
def _split4(v):
    """[A, B, 4] -> the four [A, B] slices along the last dimension (held by one thread: no data movement)."""
    a, b = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _block_dot(w_lo, w_hi, wf, x, USE_ASM: tl.constexpr):
    """float32 [BLOCK_N, KB]: each 32-value block's dot product of one weight row and one activation row
    (x: _load_row's planes and factors)."""
    h0, h1, l0, l1, xs, xc = x
    if USE_ASM:  # one dp4a chain per 32-value block: the signed high bytes, x 256, the unsigned low bytes
        wl = _split4(w_lo)
        wh = _split4(w_hi)
        xh0 = _split4(h0)
        xh1 = _split4(h1)
        xl0 = _split4(l0)
        xl1 = _split4(l1)
        isum = tl.zeros(wf.shape, tl.int32)
        for j in tl.static_range(4):
            isum = _dp4a(wl[j], xh0[j], isum, "dp4a.u32.s32 $0, $1, $2, $3;")
            isum = _dp4a(wh[j], xh1[j], isum, "dp4a.u32.s32 $0, $1, $2, $3;")
        isum = isum * 256 + xc[None, :]  # one IMAD: the offset correction starts the low bytes' chain
        for j in tl.static_range(4):
            isum = _dp4a(wl[j], xl0[j], isum, "dp4a.u32.u32 $0, $1, $2, $3;")
            isum = _dp4a(wh[j], xl1[j], isum, "dp4a.u32.u32 $0, $1, $2, $3;")
    else:  # the same integers by their definition
        q0 = (_bytes(h0, True) << 8) + _bytes(l0, False)
        q1 = (_bytes(h1, True) << 8) + _bytes(l1, False)
        isum = tl.sum(tl.sum(_bytes(w_lo, False) * q0 + _bytes(w_hi, False) * q1, axis=3), axis=2) + xc[None, :]
    # isum = the block's sum of 2 * e2m1 * q: |isum| <= 12 * 32 * 2^14 < 2^24, exact in float32
    return (isum.to(tl.float32) * xs[None, :]) * wf


@triton.jit
def _accumulate(words, scale, zero, x0, x1, x2, x3, acc0, acc1, acc2, acc3, nrows, BLOCK_M: tl.constexpr,
                USE_ASM: tl.constexpr, NORMAL: tl.constexpr):
    """Decode one weight tile once and add its block dot products with each of the block's valid rows
    (x0..x3, at most BLOCK_M, the first nrows) to that row's accumulator [BLOCK_N, KB]. NORMAL: every
    scale byte lies in 1..254 (_e8m0_factor)."""
    lo, hi = _e2m1_bytes(words, zero, USE_ASM)
    f = _e8m0_factor(scale, NORMAL)
    acc0 += _block_dot(lo, hi, f, x0, USE_ASM)
    if BLOCK_M > 1:
        if nrows > 1:
            acc1 += _block_dot(lo, hi, f, x1, USE_ASM)
    if BLOCK_M > 2:
        if nrows > 2:
            acc2 += _block_dot(lo, hi, f, x2, USE_ASM)
        if nrows > 3:
            acc3 += _block_dot(lo, hi, f, x3, USE_ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _row_out(acc, acc_up, r, mb, ks, stride_part, rweight, out_ptr, out_s_ptr, offs_n, n0, alpha, limit,
             ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, ROUTER_WEIGHT: tl.constexpr, PARTIAL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OUT_N: tl.constexpr):
    """Epilogue of padded row mb*BLOCK_M + r (its accumulators hold the biases, _bias_acc): activation
    (quantized h out) or router weight (rweight; bf16 y out). PARTIAL (split-K, K chunk ks): float32 sums
    into slice ks of the partial buffer, gate then up as they are (bias and activation follow in
    _activate_partials_kernel), or y times the router weight with the bias in chunk 0 only."""
    row = (mb * BLOCK_M + r).to(tl.int64)
    v = tl.sum(acc, axis=1)
    if ACTIVATION != 0:
        up = tl.sum(acc_up, axis=1)
        if PARTIAL:
            dst = out_ptr + ks.to(tl.int64) * stride_part + row * (2 * OUT_N) + offs_n
            tl.store(dst, v)
            tl.store(dst + OUT_N, up)
        else:
            v = _activate(v, up, alpha, limit, ACTIVATION, HAS_LIMIT)
            _quantize_store(v, out_ptr + row * (OUT_N // 2), out_s_ptr + row * (OUT_N // 16), n0, OUT_N, BLOCK_N)
    else:
        if ROUTER_WEIGHT:
            v = v * rweight
        if PARTIAL:
            tl.store(out_ptr + ks.to(tl.int64) * stride_part + row * OUT_N + offs_n, v)
        else:
            tl.store(out_ptr + row * OUT_N + offs_n, v.to(out_ptr.dtype.element_ty))


@triton.jit
def _bias_acc(bias_ptr, expert, stride_be, offs_n, ks, OFFSET: tl.constexpr, KB: tl.constexpr,
              HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row's accumulator at the start of the K loop [BLOCK_N, KB]: zeros, with the bias (columns OFFSET..
    of the expert's bias row; in K chunk 0 only when PARTIAL) in block column 0. Loaded here, before
    the loop, its latency hides behind the loop instead of stalling the epilogue, and it lives in the
    accumulator's registers."""
    acc = tl.zeros([BLOCK_N, KB], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + OFFSET + offs_n).to(tl.float32)
        first = tl.arange(0, KB)[None, :] == 0
        if PARTIAL:
            first = first & (ks == 0)
        acc = tl.where(first, bias[:, None], acc)
    return acc


@triton.jit
def _router_weights(router_weight_ptr, p0, p1, p2, p3, S, ROUTER_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The router weights of pairs p0..p3 (rows of the block; 1.0 without ROUTER_WEIGHT, 0.0 for padding),
    loaded before the K loop so that their latency hides behind it."""
    rw0, rw1, rw2, rw3 = 1.0, 1.0, 1.0, 1.0
    if ROUTER_WEIGHT:
        rw0 = tl.load(router_weight_ptr + p0, mask=p0 < S, other=0.0).to(tl.float32)
        if BLOCK_M > 1:
            rw1 = tl.load(router_weight_ptr + p1, mask=p1 < S, other=0.0).to(tl.float32)
        if BLOCK_M > 2:
            rw2 = tl.load(router_weight_ptr + p2, mask=p2 < S, other=0.0).to(tl.float32)
            rw3 = tl.load(router_weight_ptr + p3, mask=p3 < S, other=0.0).to(tl.float32)
    return rw0, rw1, rw2, rw3


@triton.jit(do_not_specialize=["S", "E", "stride_be", "stride_part"])
def _moe_decode_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, out_s_ptr, row_pair_ptr, block_expert_ptr, router_weight_ptr,
    S, E, stride_be, stride_part, alpha, limit,
    K: tl.constexpr, NW: tl.constexpr, OUT_N: tl.constexpr, GATHER: tl.constexpr, TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTER_WEIGHT: tl.constexpr,
    K_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr, STAGES: tl.constexpr = 0, PDL: tl.constexpr = False, PAIR_ORDER: tl.constexpr = False,
    EARLY: tl.constexpr = False, NORMAL_SCALES: tl.constexpr = False,
):
    """Outputs n0..n0+BLOCK_N of the (up to 4) valid rows of dispatch block program_id(0). Weights: NW
    rows of K per expert; with ACTIVATION the gate rows are n and the up rows OUT_N + n (OUT_N = I).
    K_CHUNK > 0 (split-K): K values K_CHUNK * program_id(2) .. + K_CHUNK only (a multiple of BLOCK_K),
    partial sums out (see _row_out); stride_part: elements per K chunk's slice of the partial buffer.

    PAIR_ORDER (BLOCK_M 1): block b is pair b, block_expert_ptr the router's topk ids (ids outside
    [0, E) skip the block). EARLY (STAGES 0): the program loads the hand prefetch's two weight tiles
    before it waits for the launch before it. Until then it reads nothing that launch writes: only
    weights and the dispatch's expert ids, which were written two or more launches back (topk_ids before
    prep; for the down GEMM, prep's dispatch), and those launches have completed (kernels/pdl.py).
    NORMAL_SCALES: every E8M0 byte of w lies in 1..254 (_e8m0_factor; the caller's promise)."""
    if not EARLY:
        pdl.start(PDL)
    PARTIAL: tl.constexpr = K_CHUNK > 0
    if PARTIAL:  # steps past K in the last chunk read its last tile again, with activation factor 0
        ks = tl.program_id(2)
        kbeg = ks * K_CHUNK
        kend = tl.minimum(kbeg + K_CHUNK, K)
        span: tl.constexpr = K_CHUNK
    else:
        ks: tl.constexpr = 0
        kbeg: tl.constexpr = 0
        kend: tl.constexpr = K
        span: tl.constexpr = K
    mb = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    GATED: tl.constexpr = ACTIVATION != 0
    if PAIR_ORDER:
        expert_id = tl.load(block_expert_ptr + mb)  # the pair's topk id, any integer dtype
        if (expert_id < 0) | (expert_id >= E):
            return
        expert = expert_id.to(tl.int32)
        nrows = 1
        p0 = mb
        p1, p2, p3 = p0, p0, p0
    else:
        expert = tl.load(block_expert_ptr + mb)
        if expert >= E:
            return
        pairs = tl.load(row_pair_ptr + mb * BLOCK_M + tl.arange(0, BLOCK_M))
        nrows = tl.sum((pairs < S).to(tl.int32), axis=0)  # valid rows come first in a block
        p0 = tl.load(row_pair_ptr + mb * BLOCK_M)
        p1 = tl.load(row_pair_ptr + mb * BLOCK_M + 1 % BLOCK_M)
        p2 = tl.load(row_pair_ptr + mb * BLOCK_M + 2 % BLOCK_M)
        p3 = tl.load(row_pair_ptr + mb * BLOCK_M + 3 % BLOCK_M)
    if GATHER:  # activation row = token of the pair
        a0 = tl.where(p0 < S, p0 // TOP_K, 0)
        a1 = tl.where(p1 < S, p1 // TOP_K, 0)
        a2 = tl.where(p2 < S, p2 // TOP_K, 0)
        a3 = tl.where(p3 < S, p3 // TOP_K, 0)
    else:  # activation row = padded row
        a0 = mb * BLOCK_M
        a1 = mb * BLOCK_M + 1 % BLOCK_M
        a2 = mb * BLOCK_M + 2 % BLOCK_M
        a3 = mb * BLOCK_M + 3 % BLOCK_M

    # 0, opaque to the compiler: the byte-permute tables (zero + constant) then stay in registers
    # instead of being re-materialized before every use
    zero = E >> 31
    w_base = w_ptr + expert.to(tl.int64) * (NW * (K // 8))
    s_base = s_ptr + expert.to(tl.int64) * (NW * (K // 32))
    KB: tl.constexpr = BLOCK_K // 32
    WITH_BIAS: tl.constexpr = HAS_BIAS and not (GATED and PARTIAL)  # split gate/up sums get theirs later
    acc0 = _bias_acc(bias_ptr, expert, stride_be, offs_n, ks, 0, KB, WITH_BIAS, PARTIAL, BLOCK_N)
    acc1, acc2, acc3 = acc0, acc0, acc0
    up0 = acc0
    if GATED:
        up0 = _bias_acc(bias_ptr, expert, stride_be, offs_n, ks, OUT_N, KB, WITH_BIAS, PARTIAL, BLOCK_N)
    up1, up2, up3 = up0, up0, up0
    if STAGES > 0:  # Triton's software pipeline: weight tiles staged through shared memory
        tl.static_assert(not EARLY, "EARLY needs the hand prefetch (STAGES 0)")
        rw0, rw1, rw2, rw3 = _router_weights(router_weight_ptr, p0, p1, p2, p3, S, ROUTER_WEIGHT, BLOCK_M)
        for step in tl.range(0, span, BLOCK_K, num_stages=STAGES):
            k0 = kbeg + step
            x0, x1, x2, x3 = _load_rows(xq_ptr, xs_ptr, a0, a1, a2, a3, k0, kend, nrows, K, BLOCK_K, BLOCK_M)
            gw, gs = _load_words(w_base, s_base, n0, k0, kend, K, BLOCK_N, BLOCK_K)
            acc0, acc1, acc2, acc3 = _accumulate(gw, gs, zero, x0, x1, x2, x3, acc0, acc1, acc2, acc3, nrows,
                                                 BLOCK_M, USE_ASM, NORMAL_SCALES)
            if GATED:
                uw, us = _load_words(w_base, s_base, n0 + OUT_N, k0, kend, K, BLOCK_N, BLOCK_K)
                up0, up1, up2, up3 = _accumulate(uw, us, zero, x0, x1, x2, x3, up0, up1, up2, up3, nrows,
                                                 BLOCK_M, USE_ASM, NORMAL_SCALES)
    else:
        # Weight tiles are prefetched by hand two steps ahead (t0 = this step's, t1 = the next).
        g0w, g0s = _load_words(w_base, s_base, n0, kbeg, kend, K, BLOCK_N, BLOCK_K)
        g1w, g1s = _load_words(w_base, s_base, n0, kbeg + BLOCK_K, kend, K, BLOCK_N, BLOCK_K)
        if GATED:
            u0w, u0s = _load_words(w_base, s_base, n0 + OUT_N, kbeg, kend, K, BLOCK_N, BLOCK_K)
            u1w, u1s = _load_words(w_base, s_base, n0 + OUT_N, kbeg + BLOCK_K, kend, K, BLOCK_N, BLOCK_K)
        if EARLY:  # the two tiles are on their way: now wait for the launch before
            pdl.start(PDL)
        rw0, rw1, rw2, rw3 = _router_weights(router_weight_ptr, p0, p1, p2, p3, S, ROUTER_WEIGHT, BLOCK_M)
        for step in range(0, span, BLOCK_K):
            k0 = kbeg + step
            x0, x1, x2, x3 = _load_rows(xq_ptr, xs_ptr, a0, a1, a2, a3, k0, kend, nrows, K, BLOCK_K, BLOCK_M)
            gw, gs = g0w, g0s
            g0w, g0s = g1w, g1s
            g1w, g1s = _load_words(w_base, s_base, n0, k0 + 2 * BLOCK_K, kend, K, BLOCK_N, BLOCK_K)
            acc0, acc1, acc2, acc3 = _accumulate(gw, gs, zero, x0, x1, x2, x3, acc0, acc1, acc2, acc3, nrows, BLOCK_M,
                                                 USE_ASM, NORMAL_SCALES)
            if GATED:
                uw, us = u0w, u0s
                u0w, u0s = u1w, u1s
                u1w, u1s = _load_words(w_base, s_base, n0 + OUT_N, k0 + 2 * BLOCK_K, kend, K, BLOCK_N, BLOCK_K)
                up0, up1, up2, up3 = _accumulate(uw, us, zero, x0, x1, x2, x3, up0, up1, up2, up3, nrows, BLOCK_M,
                                                 USE_ASM, NORMAL_SCALES)

    _row_out(acc0, up0, 0, mb, ks, stride_part, rw0, out_ptr, out_s_ptr, offs_n, n0, alpha, limit,
             ACTIVATION, HAS_LIMIT, ROUTER_WEIGHT, PARTIAL, BLOCK_M, BLOCK_N, OUT_N)
    if BLOCK_M > 1:
        if nrows > 1:
            _row_out(acc1, up1, 1, mb, ks, stride_part, rw1, out_ptr, out_s_ptr, offs_n, n0, alpha,
                     limit, ACTIVATION, HAS_LIMIT, ROUTER_WEIGHT, PARTIAL, BLOCK_M, BLOCK_N, OUT_N)
    if BLOCK_M > 2:
        if nrows > 2:
            _row_out(acc2, up2, 2, mb, ks, stride_part, rw2, out_ptr, out_s_ptr, offs_n, n0, alpha,
                     limit, ACTIVATION, HAS_LIMIT, ROUTER_WEIGHT, PARTIAL, BLOCK_M, BLOCK_N, OUT_N)
        if nrows > 3:
            _row_out(acc3, up3, 3, mb, ks, stride_part, rw3, out_ptr, out_s_ptr, offs_n, n0, alpha,
                     limit, ACTIVATION, HAS_LIMIT, ROUTER_WEIGHT, PARTIAL, BLOCK_M, BLOCK_N, OUT_N)


def decode_gemm(xq, xs, w, scale, bias, d, *, out_features: int, gather: bool, activation: int = 0,
                alpha: float = 1.0, limit: float | None = None, router_weights=None, block_n: int, block_k: int,
                num_warps: int = 4, split_k: int = 1, stages: int = 0, pair_ids: torch.Tensor | None = None,
                early: bool = False, normal_scales: bool = False):
    """One GEMM over the valid rows of dispatch `d` (block_m <= 4). xq/xs: quantized activations
    (x rows by token with gather, else one per padded row); w int32 words [E, NW, K/8], scale uint8
    [E, NW, K/32]. With an activation (gate rows n, up rows out_features + n) returns the quantized
    intermediate (hq int32 [max_rows, 4, out/8], hs float32 [max_rows, 2, out/32]); else float32 [max_rows,
    out_features] times the router weights (combine rounds each token's sum once). Rows that are padding
    are left unwritten.

    split_k > 1: K is cut into at most split_k chunks of whole BLOCK_K tiles, one program each, and the
    result is float32 partial sums [chunks, max_rows, width]: with an activation width 2 * out_features
    (gate sums then up sums, no bias or activation: activate_partials finishes them), else out_features
    (times the router weight, the bias counted in chunk 0: combine_partials sums them).

    pair_ids: the flat topk ids of a pair-order dispatch (prep(pair_order=True)): block b is pair b and
    its expert pair_ids[b]. early (stages 0): each program loads its first two weight tiles before it
    waits for the launch before it (see _moe_decode_kernel); the caller guarantees that the expert ids
    it reads (pair_ids, else the dispatch) were written two or more launches back. normal_scales: the caller
    guarantees every byte of `scale` lies in 1..254 (no subnormal 2^-127, no NaN): one instruction per
    scale byte instead of five (moe_mxfp4.scale_facts checks it once per layer)."""
    E, NW, words = w.shape
    K = words * 8
    if d.block_m not in (1, 2, 4):
        raise ValueError(f"decode_gemm: dispatch block_m must be 1, 2 or 4, got {d.block_m}")
    if out_features % block_n or block_k % 32 or (activation and block_n % 32):
        raise ValueError(f"decode_gemm: block_n {block_n} must divide {out_features} (and be a multiple of 32 "
                         f"with an activation), block_k {block_k} a multiple of 32")
    block_k = min(block_k, 1 << (K.bit_length() - 1))  # a tile never exceeds K (see _tile_start)
    dev = xq.device
    chunks, k_chunk = 1, 0
    if split_k > 1:
        tiles = triton.cdiv(K, block_k)
        k_chunk = triton.cdiv(tiles, split_k) * block_k
        chunks = triton.cdiv(K, k_chunk)  # no chunk left empty
        width = 2 * out_features if activation else out_features
        out = torch.empty(chunks, d.max_rows, width, dtype=torch.float32, device=dev)
        out_s = None
    elif activation:
        out = torch.empty(d.max_rows, 4, out_features // 8, dtype=torch.int32, device=dev)
        out_s = torch.empty(d.max_rows, 2, out_features // 32, dtype=torch.float32, device=dev)
    else:  # float32: the k rows of a token are rounded once, after combine's sum (1.6e-3 relative, not 2.4e-3)
        out = torch.empty(d.max_rows, out_features, dtype=torch.float32, device=dev)
        out_s = None
    plain = split_k <= 1 and activation
    if d.max_rows == 0:
        return (out, out_s) if plain else out
    dummy = d.pair_row
    S = d.pair_row.shape[0]
    if early and stages:
        raise ValueError(f"decode_gemm: early loads the hand prefetch's tiles: it needs stages 0, got {stages}")
    if pair_ids is not None and (d.block_m != 1 or pair_ids.shape != (S,) or d.max_blocks != S):
        raise ValueError(f"decode_gemm: pair_ids [{S}] need a pair-order dispatch (block_m 1, {S} blocks), got "
                         f"{tuple(pair_ids.shape)} with block_m {d.block_m} and {d.max_blocks} blocks")
    grid = (d.max_blocks, out_features // block_n, chunks)
    _moe_decode_kernel[grid](
        xq, xs, w, scale, bias if bias is not None else dummy, out, out_s if out_s is not None else dummy,
        d.row_pair, d.block_expert if pair_ids is None else pair_ids,
        router_weights if router_weights is not None else dummy,
        S, E, bias.stride(0) if bias is not None else 0, out[0].numel() if k_chunk else 0, float(alpha),
        float(limit) if limit is not None else 0.0,
        K=K, NW=NW, OUT_N=out_features, GATHER=gather, TOP_K=d.top_k, ACTIVATION=activation,
        HAS_LIMIT=limit is not None, HAS_BIAS=bias is not None, ROUTER_WEIGHT=router_weights is not None,
        K_CHUNK=k_chunk, BLOCK_M=d.block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_ASM=not interpreting(),
        STAGES=stages, PAIR_ORDER=pair_ids is not None, EARLY=early, NORMAL_SCALES=normal_scales,
        num_warps=num_warps, num_stages=1,
        **pdl.launch_options(dev),
    )
    return (out, out_s) if plain else out


@triton.jit(do_not_specialize=["S", "stride_be", "stride_part"])
def _activate_partials_kernel(part_ptr, bias_ptr, hq_ptr, hs_ptr, row_pair_ptr, block_expert_ptr, S, stride_be,
                              stride_part, alpha, limit, N: tl.constexpr, CHUNKS: tl.constexpr,
                              ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Columns n0..n0+BLOCK of padded row program_id(0): the K chunks' gate and up sums added in chunk
    order, biases, activation, quantized into the hq/hs layout."""
    pdl.start(PDL)
    row = tl.program_id(0)
    if tl.load(row_pair_ptr + row) >= S:  # padding
        return
    n0 = tl.program_id(1) * BLOCK
    offs = n0 + tl.arange(0, BLOCK)
    mask = offs < N
    src = part_ptr + row.to(tl.int64) * (2 * N) + offs
    gate = tl.zeros([BLOCK], tl.float32)
    up = tl.zeros([BLOCK], tl.float32)
    for ks in tl.static_range(CHUNKS):
        gate += tl.load(src + ks * stride_part, mask=mask, other=0.0)
        up += tl.load(src + ks * stride_part + N, mask=mask, other=0.0)
    if HAS_BIAS:
        b_base = bias_ptr + tl.load(block_expert_ptr + row // BLOCK_M).to(tl.int64) * stride_be
        gate += tl.load(b_base + offs, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(b_base + N + offs, mask=mask, other=0.0).to(tl.float32)
    v = _activate(gate, up, alpha, limit, ACTIVATION, HAS_LIMIT)
    _quantize_store(v, hq_ptr + row.to(tl.int64) * (N // 2), hs_ptr + row.to(tl.int64) * (N // 16), n0, N, BLOCK)


def activate_partials(part, bias, d, *, activation: int, alpha: float = 1.0, limit: float | None = None):
    """decode_gemm's split-K gate/up sums [chunks, max_rows, 2I] -> (hq, hs) as the unsplit GEMM
    returns them: bias [E, 2I] (or None) and activation applied, padding rows left unwritten."""
    chunks, rows, width = part.shape
    inter = width // 2
    hq = torch.empty(rows, 4, inter // 8, dtype=torch.int32, device=part.device)
    hs = torch.empty(rows, 2, inter // 32, dtype=torch.float32, device=part.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _activate_partials_kernel[(rows, triton.cdiv(inter, block))](
            part, bias if bias is not None else part, hq, hs, d.row_pair, d.block_expert, d.pair_row.shape[0],
            bias.stride(0) if bias is not None else 0, part[0].numel(), float(alpha),
            float(limit) if limit is not None else 0.0, N=inter, CHUNKS=chunks, ACTIVATION=activation,
            HAS_LIMIT=limit is not None, HAS_BIAS=bias is not None, BLOCK_M=d.block_m, BLOCK=block,
            **pdl.launch_options(part.device))
    return hq, hs


@triton.jit(do_not_specialize=["stride_part"])
def _combine_partials_kernel(part_ptr, pair_row_ptr, out_ptr, stride_part, H: tl.constexpr, TOP_K: tl.constexpr,
                             CHUNKS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pair_row_ptr + t * TOP_K + j)
        src = part_ptr + row.to(tl.int64) * H + h
        for ks in tl.static_range(CHUNKS):
            acc += tl.load(src + ks * stride_part, mask=(h < H) & (row >= 0), other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


def combine_partials(part, d, num_tokens: int, out_dtype: torch.dtype) -> torch.Tensor:
    """moe_dispatch.combine over decode_gemm's split-K down sums [chunks, max_rows, H]: out[t] = the sum
    over slots j, then chunks, of part[chunk, pair_row[t*k + j]], in that fixed order (deterministic)."""
    chunks, _, H = part.shape
    out = torch.empty(num_tokens, H, dtype=out_dtype, device=part.device)
    if num_tokens:
        block_h = min(1024, triton.next_power_of_2(H))
        _combine_partials_kernel[(num_tokens, triton.cdiv(H, block_h))](
            part, d.pair_row, out, part[0].numel(), H=H, TOP_K=d.top_k, CHUNKS=chunks, BLOCK_H=block_h,
            **pdl.launch_options(part.device))
    return out


def moe_layer_decode(x, topk_ids, topk_weights, w13, s13, w2, s2, b13, b2, activation, *, inter: int,
                     config: DecodeConfig, normal_scales: bool = False) -> torch.Tensor:
    """dispatch + quantize x -> gate/up GEMM (bias, activation, quantized h) -> down GEMM (bias, router
    weight) -> combine. Arguments checked by moe_experts_mxfp4; w13/w2 int32 words. With config.split_k1
    the gate/up GEMM leaves partial sums and activate_partials (one more launch) finishes h; with
    split_k2 combine_partials sums the down GEMM's chunks with the k slots (in place of combine).
    normal_scales: every byte of s13 and s2 lies in 1..254 (see decode_gemm), as the caller checked."""
    from dayzero.kernels.moe_dispatch import combine, dispatch

    T, H = x.shape
    E = w13.shape[0]
    pair_ids = None
    if config.pair_order:
        if topk_ids.numel() > PREP_MAX_PAIRS:
            raise ValueError(f"moe_layer_decode: pair_order needs at most {PREP_MAX_PAIRS} pairs, got "
                             f"{topk_ids.numel()}")
        topk_ids = topk_ids.contiguous()  # the tensor prep reads too: written before prep
        pair_ids = topk_ids.view(-1)
        d, xq, xs = prep(x, topk_ids, E, 1, pair_order=True)
    elif topk_ids.numel() <= PREP_MAX_PAIRS:
        d, xq, xs = prep(x, topk_ids, E, config.block_m)
    else:
        d = dispatch(topk_ids, E, config.block_m)
        xq, xs = quantize_rows(x)
    act, alpha = kernel_activation(activation)
    tiles1 = dict(block_n=config.block_n1, block_k=config.block_k1, num_warps=config.num_warps1, stages=config.stages1,
                  pair_ids=pair_ids, early=config.early1, normal_scales=normal_scales)
    if config.gluon1:
        from dayzero.kernels.moe_decode_sm90 import decode_gemm_sm90

        hq, hs = decode_gemm_sm90(xq, xs, w13, s13, b13, pair_ids, top_k=topk_ids.shape[1], out_features=inter,
                                  gather=True, activation=act, alpha=alpha, limit=activation.limit,
                                  block_n=config.block_n1, block_k=config.block_k1, num_warps=config.num_warps1,
                                  stages=config.stages1, normal_scales=normal_scales, smem=config.smem1)
    elif config.split_k1 > 1:
        part = decode_gemm(xq, xs, w13, s13, None, d, out_features=inter, gather=True, activation=act,
                           split_k=config.split_k1, **tiles1)
        hq, hs = activate_partials(part, b13, d, activation=act, alpha=alpha, limit=activation.limit)
    else:
        hq, hs = decode_gemm(xq, xs, w13, s13, b13, d, out_features=inter, gather=True, activation=act, alpha=alpha,
                             limit=activation.limit, **tiles1)
    if config.gluon2:
        from dayzero.kernels.moe_decode_sm90 import decode_gemm_sm90

        y = decode_gemm_sm90(hq, hs, w2, s2, b2, pair_ids, top_k=topk_ids.shape[1], out_features=H, gather=False,
                             router_weights=topk_weights.contiguous().view(-1), block_n=config.block_n2,
                             block_k=config.block_k2, num_warps=config.num_warps2, stages=config.stages2,
                             normal_scales=normal_scales, smem=config.smem2)
        return combine(y, d, T, x.dtype)
    y = decode_gemm(hq.view(-1, inter // 2), hs, w2, s2, b2, d, out_features=H, gather=False,
                    router_weights=topk_weights.contiguous().view(-1), block_n=config.block_n2,
                    block_k=config.block_k2, num_warps=config.num_warps2, split_k=config.split_k2,
                    stages=config.stages2, pair_ids=pair_ids, early=config.early2, normal_scales=normal_scales)
    if config.split_k2 > 1:
        return combine_partials(y, d, T, x.dtype)
    return combine(y, d, T, x.dtype)


SPLITK_ENV = "DAYZERO_MOE_DECODE_SPLITK"  # "1" (or a chunk count >= 2): split K of a gate/up GEMM with few programs
SPLITK_GATE_UP = 4  # K chunks of the gate/up GEMM when split with "1"


def splitk_chunks() -> int:
    """The gate/up K chunks DAYZERO_MOE_DECODE_SPLITK asks for: 1 (unset, "0": no split), SPLITK_GATE_UP
    for "1", or the count it gives."""
    value = os.environ.get(SPLITK_ENV, "0").strip()
    if value in ("", "0"):
        return 1
    if value == "1":
        return SPLITK_GATE_UP
    if not value.isdigit():
        raise ValueError(f"{SPLITK_ENV} must be 0, 1 or a number of K chunks, got {value!r}")
    return int(value)



DECODE_MAX_ROWS_PER_EXPERT = 3.5  # expected pairs per active expert up to which the decode kernels run
# ... where moe_wgmma runs (sm_90): its 16-row blocks measured 1.08x faster at 3.2 rows (DeepSeek-V4, 128
# tokens), 0.71x at 1.6 (gpt-oss-120b, 32 tokens), 0.82x at 2.3 (gpt-oss, 64 tokens) and 1.02x at 1.9
# (DeepSeek-V4, 64 tokens); 2.5 is also where the decode kernels would go to 4-row blocks
DECODE_MAX_ROWS_WGMMA = 2.5


def expected_active_experts(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Distinct experts a step activates on average if each token picks top_k of E uniformly."""
    return num_experts * (1 - (1 - min(top_k, num_experts) / num_experts) ** num_tokens)


# One token on sm_90 (pair order, the gate/up GEMM with few programs): the Gluon GEMMs of moe_decode_sm90,
# (block_n, block_k, warps, stages, smem) of gate/up and down. Measured on the H200 (bench/moe_decode.py
# --gluon-ab, 2026-12-01 tenth run, 8 layers per graph, every variant timed in turn, BENCHMARKS.md):
# gate/up 32 x 256 x 8 through a 3-slot shared-memory ring 1.11x / 1.05x the Triton layer alone
# (gpt-oss-120b / DeepSeek-V4), down 32 x 512 x 8 through 3 slots 1.08x / 1.06x, both 1.20x / 1.14x.
# From 8 tokens the Triton kernels stay (the Gluon GEMMs measured 0.87-1.04x there).
GLUON_ONE_TOKEN = ((32, 256, 8, 3, True), (32, 512, 8, 3, True))


def choose_decode_config(num_tokens: int, num_pairs: int, num_experts: int, hidden: int, inter: int,
                         num_sms: int = 132, max_rows: float = DECODE_MAX_ROWS_PER_EXPERT,
                         gluon: bool = False) -> DecodeConfig | None:
    """The decode kernels' tiles from static sizes alone, or None where the tensor-core GEMM should run
    (more than max_rows expected rows per active expert. DECODE_MAX_ROWS_PER_EXPERT against moe_gemm's
    tensor-core kernel: on the H200 the decode kernels were faster at 64 tokens on gpt-oss-120b shapes
    (2.3 rows) and at 128 tokens on DeepSeek-V4 shapes (3.2 rows), slower at 128 tokens on gpt-oss-120b
    (4.1 rows); DECODE_MAX_ROWS_WGMMA against moe_wgmma's 16-row blocks, where that kernel runs).

    Measured on the H200 (bench/moe_decode.py; docs/kernels.md, 2026-12-01 sweeps): BLOCK_M 1 while
    experts see about one row, else 2 (4 past 2.5 rows); Triton's 3-stage pipeline through shared
    memory everywhere (fewer registers, more programs and bytes in flight per SM: 4-6% faster layers
    at one token, 11-19% at 8-32 tokens than the register prefetch); gate/up 32 x 512 tiles of 8 warps
    where the GEMM has few programs (one token), else 32 x 512 (BLOCK_M 1) or 32 x 256 (above) of 4
    warps; down 32 x 512 at BLOCK_M 1 and 64 x 256 above. Where the gate/up GEMM has few programs (one
    token), the down GEMM uses the hand prefetch with its first two tiles loaded before its PDL wait
    (early2: 7-18% faster layers at one token, slower from 8 tokens), 32 x 1024 over 8 warps where its
    programs fit three per SM (gpt-oss-120b: 360 programs; DeepSeek-V4's 768 keep 32 x 512 x 4). BLOCK_M 1
    dispatches in pair order (neutral to 8% faster). With DAYZERO_MOE_DECODE_SPLITK=1 (or =N), a
    gate/up GEMM with few programs is split into SPLITK_GATE_UP (or N) K chunks across programs
    (measured no faster at 4-16 chunks).

    gluon (the caller found moe_decode_sm90.available): at one token (pair order, few gate/up programs)
    each GEMM whose GLUON_ONE_TOKEN tile fits its shapes runs the Gluon kernel instead.

    Computed once per distinct set of arguments (and split-K setting): a layer call asks for it on the host."""
    return _choose_decode_config(num_tokens, num_pairs, num_experts, hidden, inter, num_sms, max_rows, gluon,
                                 splitk_chunks())


@functools.cache
def _choose_decode_config(num_tokens: int, num_pairs: int, num_experts: int, hidden: int, inter: int,
                          num_sms: int, max_rows: float, gluon: bool, split: int) -> DecodeConfig | None:
    top_k = max(1, num_pairs // max(1, num_tokens))
    active = max(1.0, expected_active_experts(num_tokens, top_k, num_experts))
    rows = num_pairs / active
    if rows > max_rows:
        return None
    block_m = 1 if rows <= 1.25 else 2 if rows <= 2.5 else 4
    few1 = active * inter / 32 < 4 * num_sms
    if few1:  # one token: K split over the 8 warps of a program
        n1, k1, w1 = 32, 512, 8
    else:
        n1, k1, w1 = (32, 512, 4) if block_m == 1 else (32, 256, 4)
    if block_m > 1 and hidden % 64 == 0:
        n2, k2, w2 = 64, 256, 4
    else:
        n2, k2, w2 = 32, 512, 4
    s1 = s2 = 3
    early2 = False
    if few1:  # the down GEMM's first two tiles stream in while the gate/up GEMM finishes
        s2, early2 = 0, True
        if active * hidden / 32 <= 3 * num_sms:  # its programs fit 3 per SM: K over 8 warps
            n2, k2, w2 = 32, 1024, 8
    split1 = split if few1 else 1
    pair_order = block_m == 1 and num_pairs <= PREP_MAX_PAIRS
    config = DecodeConfig(block_m, n1, n2, k1, k2, w1, w2, split1, stages1=s1, stages2=s2, pair_order=pair_order,
                          early2=early2)
    if gluon and few1 and pair_order and split1 == 1:
        import dataclasses

        from dayzero.kernels.moe_decode_sm90 import tile_fits

        (gn1, gk1, gw1, gs1, gm1), (gn2, gk2, gw2, gs2, gm2) = GLUON_ONE_TOKEN
        if inter % gn1 == 0 and tile_fits(gn1, _clamp_k(gk1, hidden), gw1):
            config = dataclasses.replace(config, gluon1=True, block_n1=gn1, block_k1=gk1, num_warps1=gw1,
                                         stages1=gs1, smem1=gm1)
        if hidden % gn2 == 0 and tile_fits(gn2, _clamp_k(gk2, inter), gw2):
            config = dataclasses.replace(config, gluon2=True, block_n2=gn2, block_k2=gk2, num_warps2=gw2,
                                         stages2=gs2, smem2=gm2, early2=False)
    return config


def _clamp_k(block_k: int, K: int) -> int:
    """The K tile a decode GEMM runs for block_k over K (never wider than K, see decode_gemm)."""
    return min(block_k, 1 << (K.bit_length() - 1))
