"""The decode GEMMs of path A (few rows per expert, MXFP4 weights; the "decode" kernel, composed into a
layer by _layer.py): integer dot products on the CUDA cores instead of tensor-core MMAs, so that the
weights are decoded once, in registers, with a few integer instructions per code, and never travel
through shared memory.

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
  k-slot reduction (_dispatch.combine), so a token's sum is rounded to bf16 once.
- The layer is four launches, with no host synchronisation: `prep` (the dispatch of up to 512 pairs
  in one program, without atomics, and the quantization of x in the others), the two GEMMs, combine;
  on sm_90 each launched with programmatic dependent launch (kernels/pdl.py), so that the next one's
  launch and ramp-up overlap the previous one's tail.
- With block_m 1 (about one row per expert) and at most 512 pairs the dispatch is in pair order: block
  b is pair b, unsorted, and both GEMMs read their expert straight from topk_ids (written by the router,
  before prep), so the down GEMM (DecodeConfig.early2) can request its first weight tiles before it waits
  for the gate/up GEMM. At one token on sm_90 the GEMMs run as _decode_sm90's Gluon kernels instead
  (DecodeConfig.gluon1/gluon2): the same arithmetic with the data movement written out.

Why this shape: at one token the layer is bound by latency and by issued instructions about equally.
The offset bytes cut the integer work per weight word from 16 to 9 instructions; the pipelined loop
(tiles through shared memory, fewer registers, more programs in flight) is 10-25% faster at 8-128
tokens; the early down GEMM 7-18% at one token; the one-shift scale factors 1-5%. Biases and router
weights are loaded before the K loop (the bias into the accumulator), not in the epilogue, where their
latency stalled every program.

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

import torch
import triton
import triton.language as tl

from dayzero.kernels import pdl
from dayzero.kernels.moe._common import _activate, interpreting
from dayzero.kernels.moe._dispatch import Dispatch, dispatch_sizes
from dayzero.kernels.moe.configs import PREP_MAX_PAIRS


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
    """Program 0: the dispatch of S <= BS pairs (_dispatch's layout, pairs of an expert in pair
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


def prep(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, block_m: int, pair_order: bool = False):
    """(Dispatch, xq, xs) in one launch for at most PREP_MAX_PAIRS pairs: _dispatch.dispatch's
    block_expert/row_pair/pair_row (pairs of an expert in pair order; counts and expert_block are not
    computed: None) and quantize_rows(x). pair_order (block_m 1): unsorted, block = row = pair (ids
    outside [0, E) give an empty block), S blocks."""
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
def _tile_start(k0, K, BLOCK_K: tl.constexpr):
    """Where the K tile of step k0 is read from: k0, or K - BLOCK_K for a last partial tile (and for the
    prefetches past the end), so that every load is in bounds and unmasked; the blocks read twice get
    activation factor 0 (_load_row). Needs K >= BLOCK_K."""
    return tl.minimum(k0, K - BLOCK_K)


@triton.jit
def _load_words(w_base, s_base, n0, k0, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 words [BLOCK_N, BLOCK_K/32, 4] and E8M0 bytes [BLOCK_N, BLOCK_K/32] of rows n0.. for the
    K tile of step k0 (see _tile_start)."""
    KB: tl.constexpr = BLOCK_K // 32
    start = _tile_start(k0, K, BLOCK_K)
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
def _load_row(xq_ptr, xs_ptr, a_row, k0, valid, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The four byte planes [1, BLOCK_K/32, 4], the block factors [BLOCK_K/32] and the blocks' weight
    offset corrections (int32 -24 * the block's sum) of activation row a_row for the K tile of step k0 (see
    _tile_start): factor 0 for blocks before k0 (read twice) and where not valid. The planes are loaded
    2-d with the contiguity of the weight words, so that they
    land in the words' register layout and broadcast over N for free."""
    KB: tl.constexpr = BLOCK_K // 32
    start = _tile_start(k0, K, BLOCK_K)
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
def _load_rows(xq_ptr, xs_ptr, a0, a1, a2, a3, k0, nrows, K: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """_load_row for the (up to 4) rows of a block; rows past BLOCK_M are copies of row 0, never read."""
    x0 = _load_row(xq_ptr, xs_ptr, a0, k0, True, K, BLOCK_K)
    x1, x2, x3 = x0, x0, x0
    if BLOCK_M > 1:
        x1 = _load_row(xq_ptr, xs_ptr, a1, k0, nrows > 1, K, BLOCK_K)
    if BLOCK_M > 2:
        x2 = _load_row(xq_ptr, xs_ptr, a2, k0, nrows > 2, K, BLOCK_K)
        x3 = _load_row(xq_ptr, xs_ptr, a3, k0, nrows > 3, K, BLOCK_K)
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
def _row_out(acc, acc_up, r, mb, rweight, out_ptr, out_s_ptr, offs_n, n0, alpha, limit, ACTIVATION: tl.constexpr,
             HAS_LIMIT: tl.constexpr, ROUTER_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             OUT_N: tl.constexpr):
    """Epilogue of padded row mb*BLOCK_M + r (its accumulators hold the biases, _bias_acc): activation
    (quantized h out) or router weight (rweight; float32 y out)."""
    row = (mb * BLOCK_M + r).to(tl.int64)
    v = tl.sum(acc, axis=1)
    if ACTIVATION != 0:
        up = tl.sum(acc_up, axis=1)
        v = _activate(v, up, alpha, limit, ACTIVATION, HAS_LIMIT)
        _quantize_store(v, out_ptr + row * (OUT_N // 2), out_s_ptr + row * (OUT_N // 16), n0, OUT_N, BLOCK_N)
    else:
        if ROUTER_WEIGHT:
            v = v * rweight
        tl.store(out_ptr + row * OUT_N + offs_n, v.to(out_ptr.dtype.element_ty))


@triton.jit
def _bias_acc(bias_ptr, expert, stride_be, offs_n, OFFSET: tl.constexpr, KB: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """A row's accumulator at the start of the K loop [BLOCK_N, KB]: zeros, with the bias (columns OFFSET..
    of the expert's bias row) in block column 0. Loaded here, before the loop, its latency hides behind
    the loop instead of stalling the epilogue, and it lives in the accumulator's registers."""
    acc = tl.zeros([BLOCK_N, KB], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + OFFSET + offs_n).to(tl.float32)
        acc = tl.where(tl.arange(0, KB)[None, :] == 0, bias[:, None], acc)
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


@triton.jit(do_not_specialize=["S", "E", "stride_be"])
def _moe_decode_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, out_s_ptr, row_pair_ptr, block_expert_ptr, router_weight_ptr,
    S, E, alpha, limit, stride_be,
    K: tl.constexpr, NW: tl.constexpr, OUT_N: tl.constexpr, GATHER: tl.constexpr, TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTER_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr, STAGES: tl.constexpr = 0, PDL: tl.constexpr = False, PAIR_ORDER: tl.constexpr = False,
    EARLY: tl.constexpr = False, NORMAL_SCALES: tl.constexpr = False,
):
    """Outputs n0..n0+BLOCK_N of the (up to 4) valid rows of dispatch block program_id(0). Weights: NW
    rows of K per expert; with ACTIVATION the gate rows are n and the up rows OUT_N + n (OUT_N = I).

    PAIR_ORDER (BLOCK_M 1): block b is pair b, block_expert_ptr the router's topk ids (ids outside
    [0, E) skip the block). EARLY (STAGES 0): the program loads the hand prefetch's two weight tiles
    before it waits for the launch before it. Until then it reads nothing that launch writes: only
    weights and the dispatch's expert ids, which were written two or more launches back (topk_ids before
    prep; for the down GEMM, prep's dispatch), and those launches have completed (kernels/pdl.py).
    NORMAL_SCALES: every E8M0 byte of w lies in 1..254 (_e8m0_factor; the caller's promise)."""
    if not EARLY:
        pdl.start(PDL)
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
    acc0 = _bias_acc(bias_ptr, expert, stride_be, offs_n, 0, KB, HAS_BIAS, BLOCK_N)
    acc1, acc2, acc3 = acc0, acc0, acc0
    up0 = acc0
    if GATED:
        up0 = _bias_acc(bias_ptr, expert, stride_be, offs_n, OUT_N, KB, HAS_BIAS, BLOCK_N)
    up1, up2, up3 = up0, up0, up0
    if STAGES > 0:  # Triton's software pipeline: weight tiles staged through shared memory
        tl.static_assert(not EARLY, "EARLY needs the hand prefetch (STAGES 0)")
        rw0, rw1, rw2, rw3 = _router_weights(router_weight_ptr, p0, p1, p2, p3, S, ROUTER_WEIGHT, BLOCK_M)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            x0, x1, x2, x3 = _load_rows(xq_ptr, xs_ptr, a0, a1, a2, a3, k0, nrows, K, BLOCK_K, BLOCK_M)
            gw, gs = _load_words(w_base, s_base, n0, k0, K, BLOCK_N, BLOCK_K)
            acc0, acc1, acc2, acc3 = _accumulate(gw, gs, zero, x0, x1, x2, x3, acc0, acc1, acc2, acc3, nrows,
                                                 BLOCK_M, USE_ASM, NORMAL_SCALES)
            if GATED:
                uw, us = _load_words(w_base, s_base, n0 + OUT_N, k0, K, BLOCK_N, BLOCK_K)
                up0, up1, up2, up3 = _accumulate(uw, us, zero, x0, x1, x2, x3, up0, up1, up2, up3, nrows,
                                                 BLOCK_M, USE_ASM, NORMAL_SCALES)
    else:
        # Weight tiles are prefetched by hand two steps ahead (t0 = this step's, t1 = the next).
        g0w, g0s = _load_words(w_base, s_base, n0, 0, K, BLOCK_N, BLOCK_K)
        g1w, g1s = _load_words(w_base, s_base, n0, BLOCK_K, K, BLOCK_N, BLOCK_K)
        if GATED:
            u0w, u0s = _load_words(w_base, s_base, n0 + OUT_N, 0, K, BLOCK_N, BLOCK_K)
            u1w, u1s = _load_words(w_base, s_base, n0 + OUT_N, BLOCK_K, K, BLOCK_N, BLOCK_K)
        if EARLY:  # the two tiles are on their way: now wait for the launch before
            pdl.start(PDL)
        rw0, rw1, rw2, rw3 = _router_weights(router_weight_ptr, p0, p1, p2, p3, S, ROUTER_WEIGHT, BLOCK_M)
        for k0 in range(0, K, BLOCK_K):
            x0, x1, x2, x3 = _load_rows(xq_ptr, xs_ptr, a0, a1, a2, a3, k0, nrows, K, BLOCK_K, BLOCK_M)
            gw, gs = g0w, g0s
            g0w, g0s = g1w, g1s
            g1w, g1s = _load_words(w_base, s_base, n0, k0 + 2 * BLOCK_K, K, BLOCK_N, BLOCK_K)
            acc0, acc1, acc2, acc3 = _accumulate(gw, gs, zero, x0, x1, x2, x3, acc0, acc1, acc2, acc3, nrows, BLOCK_M,
                                                 USE_ASM, NORMAL_SCALES)
            if GATED:
                uw, us = u0w, u0s
                u0w, u0s = u1w, u1s
                u1w, u1s = _load_words(w_base, s_base, n0 + OUT_N, k0 + 2 * BLOCK_K, K, BLOCK_N, BLOCK_K)
                up0, up1, up2, up3 = _accumulate(uw, us, zero, x0, x1, x2, x3, up0, up1, up2, up3, nrows, BLOCK_M,
                                                 USE_ASM, NORMAL_SCALES)

    _row_out(acc0, up0, 0, mb, rw0, out_ptr, out_s_ptr, offs_n, n0, alpha, limit, ACTIVATION, HAS_LIMIT,
             ROUTER_WEIGHT, BLOCK_M, BLOCK_N, OUT_N)
    if BLOCK_M > 1:
        if nrows > 1:
            _row_out(acc1, up1, 1, mb, rw1, out_ptr, out_s_ptr, offs_n, n0, alpha, limit, ACTIVATION, HAS_LIMIT,
                     ROUTER_WEIGHT, BLOCK_M, BLOCK_N, OUT_N)
    if BLOCK_M > 2:
        if nrows > 2:
            _row_out(acc2, up2, 2, mb, rw2, out_ptr, out_s_ptr, offs_n, n0, alpha, limit, ACTIVATION, HAS_LIMIT,
                     ROUTER_WEIGHT, BLOCK_M, BLOCK_N, OUT_N)
        if nrows > 3:
            _row_out(acc3, up3, 3, mb, rw3, out_ptr, out_s_ptr, offs_n, n0, alpha, limit, ACTIVATION, HAS_LIMIT,
                     ROUTER_WEIGHT, BLOCK_M, BLOCK_N, OUT_N)


def decode_gemm(xq, xs, w, scale, bias, d, *, out_features: int, gather: bool, activation: int = 0,
                alpha: float = 1.0, limit: float | None = None, router_weights=None, block_n: int, block_k: int,
                num_warps: int = 4, stages: int = 0, pair_ids: torch.Tensor | None = None,
                early: bool = False, normal_scales: bool = False):
    """One GEMM over the valid rows of dispatch `d` (block_m <= 4). xq/xs: quantized activations
    (x rows by token with gather, else one per padded row); w int32 words [E, NW, K/8], scale uint8
    [E, NW, K/32]. With an activation (gate rows n, up rows out_features + n) returns the quantized
    intermediate (hq int32 [max_rows, 4, out/8], hs float32 [max_rows, 2, out/32]); else float32 [max_rows,
    out_features] times the router weights (combine rounds each token's sum once). Rows that are padding
    are left unwritten.

    pair_ids: the flat topk ids of a pair-order dispatch (prep(pair_order=True)): block b is pair b and
    its expert pair_ids[b]. early (stages 0): each program loads its first two weight tiles before it
    waits for the launch before it (see _moe_decode_kernel); the caller guarantees that the expert ids
    it reads (pair_ids, else the dispatch) were written two or more launches back. normal_scales: the caller
    guarantees every byte of `scale` lies in 1..254 (no subnormal 2^-127, no NaN): one instruction per
    scale byte instead of five (_layer.scale_facts checks it once per layer)."""
    E, NW, words = w.shape
    K = words * 8
    if d.block_m not in (1, 2, 4):
        raise ValueError(f"decode_gemm: dispatch block_m must be 1, 2 or 4, got {d.block_m}")
    if out_features % block_n or block_k % 32 or (activation and block_n % 32):
        raise ValueError(f"decode_gemm: block_n {block_n} must divide {out_features} (and be a multiple of 32 "
                         f"with an activation), block_k {block_k} a multiple of 32")
    block_k = min(block_k, 1 << (K.bit_length() - 1))  # a tile never exceeds K (see _tile_start)
    dev = xq.device
    if activation:
        out = torch.empty(d.max_rows, 4, out_features // 8, dtype=torch.int32, device=dev)
        out_s = torch.empty(d.max_rows, 2, out_features // 32, dtype=torch.float32, device=dev)
    else:  # float32: the k rows of a token are rounded once, after combine's sum (1.6e-3 relative, not 2.4e-3)
        out = torch.empty(d.max_rows, out_features, dtype=torch.float32, device=dev)
        out_s = None
    if d.max_rows == 0:
        return (out, out_s) if activation else out
    dummy = d.pair_row
    S = d.pair_row.shape[0]
    if early and stages:
        raise ValueError(f"decode_gemm: early loads the hand prefetch's tiles: it needs stages 0, got {stages}")
    if pair_ids is not None and (d.block_m != 1 or pair_ids.shape != (S,) or d.max_blocks != S):
        raise ValueError(f"decode_gemm: pair_ids [{S}] need a pair-order dispatch (block_m 1, {S} blocks), got "
                         f"{tuple(pair_ids.shape)} with block_m {d.block_m} and {d.max_blocks} blocks")
    grid = (d.max_blocks, out_features // block_n)
    _moe_decode_kernel[grid](
        xq, xs, w, scale, bias if bias is not None else dummy, out, out_s if out_s is not None else dummy,
        d.row_pair, d.block_expert if pair_ids is None else pair_ids,
        router_weights if router_weights is not None else dummy,
        S, E, float(alpha), float(limit) if limit is not None else 0.0, bias.stride(0) if bias is not None else 0,
        K=K, NW=NW, OUT_N=out_features, GATHER=gather, TOP_K=d.top_k, ACTIVATION=activation,
        HAS_LIMIT=limit is not None, HAS_BIAS=bias is not None, ROUTER_WEIGHT=router_weights is not None,
        BLOCK_M=d.block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_ASM=not interpreting(),
        STAGES=stages, PAIR_ORDER=pair_ids is not None, EARLY=early, NORMAL_SCALES=normal_scales,
        num_warps=num_warps, num_stages=1,
        **pdl.launch_options(dev),
    )
    return (out, out_s) if activation else out
