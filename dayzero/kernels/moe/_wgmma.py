"""Prefill GEMM for MXFP4 experts on Hopper (sm_90), the "wgmma" kernel of path A, written in Gluon: the weights are upcast in
registers straight into the wgmma register-operand layout (no shared-memory round trip), the
activations come by TMA into a ring of shared-memory tiles, and the MMA is issued asynchronously.

Why: _mma.py (plain Triton) stores each upcast weight tile to shared memory for the MMA, changes the
scale tile's layout through shared memory and spends about 500 instructions per thread per K step
(7.8 per upcast value). Here the K loop is about 210 instructions per thread for 32 values
(tools/sass_moe_wgmma.py), with no shared-memory traffic besides TMA: 1.7-2.2x the mma kernel from 512
to 8192 tokens (61-67% of the bf16 matmul rate at 8192), and with 16-row blocks from 3 rows per expert.

    acc[BLOCK_N weight rows, BLOCK_T padded rows] = W[BLOCK_N, K] @ X[BLOCK_T, K]^T

W (left operand, registers): 8 warps (two warpgroups) x 64 rows = BLOCK_N 128 weight rows; X (right
operand, shared memory): BLOCK_T rows of the dispatched activations, TMA tiles in a ring of STAGES.
Register kernel, per K tile of 64: upcast tile i, load the words of tile i + 1, wait for X tile i,
wgmma, wait for it, refill the slot of tile i - 1; upcast and MMA overlap only across the two programs
an SM holds at BLOCK_T 64-128 (128 registers). PIPELINE (the default above 96 rows per expert): the loop
unrolled twice over two register sets, so one wgmma stays in flight while the next tile is upcast, the
words loaded two tiles ahead (the kernel comment says what the compilers need for this). SCHEDULED:
the blocks come from a _dispatch.BlockList (big blocks and tail blocks, WgmmaConfig.tail_blocks), stores
stopping at each expert's last row.

The K permutation. A thread of the wgmma A fragment (bf16, 64 x 16 per warp group step) holds, of each
of its two rows, logical columns k with k = h + 2 c + 8 s + 32 r  (c: lane % 4, h, s, r: registers).
Two E2M1 codes 16 bits apart in a weight word (nibbles j and j + 4) become one bf16x2 register with
_common.py's shift trick, so a thread must hold whole words whose nibbles map onto its k: word w of the
64-wide tile = 4 blk + 2 wib1 + wib0 and nibble j + 4 h, and the logical column of a code is
    kl = h + 2 wib1 + 4 blk + 8 (j & 1) + 16 (j >> 1) + 32 wib0,
its physical column (its place in the row of the checkpoint) 8 w + j + 4 h. The activations are laid
out in the same logical order: `gather_permute` writes the dispatched rows of x with each 64-column
block permuted (`physical_columns`), and the gate/up epilogue stores h permuted the same way, so both
GEMMs read their right operand with plain TMA tiles. The kernel converts the upcast tile to the
operand layout with assert_trivial: a layout that needed data movement would not compile. Every product
is exact in float32 up to the summation order, as in the other GEMMs.

The upcast (exact, as _common.py's): bits = ((t & 0x00070007) << 6) | ((t & 0x00080008) << 12) with
t = word >> 4j gives two bf16 holding e2m1 * 2^-126; one bf16x2 multiply by 2^(min(s,128) - 1) (NaN for
s = 0xFF) and, where a layer has scale bytes above 128 (`HIGH_SCALES`, checked once per layer by
_layer.py), a second by 2^(max(s,128) - 128) give e2m1 * 2^(s - 127).

Gate/up (GATED): the 128 accumulator rows are 64 gate rows and the 64 matching up rows, placed so that
gate row n and up row n sit in the same thread (rows 16 w + q and 16 w + 8 + q of the MMA layout, both
held by one thread), and the epilogue applies the activation in registers.

The epilogue (`_epilogue`) is a fifth to a quarter of a 256-row program's time at one program per SM (nothing
overlaps it; tools/diag_wgmma_upcast.py), so it is kept short: the sigmoid by the ex2 and rcp
approximations, the router weights loaded once per row and moved to the accumulator's layout through
shared memory, and the bf16 outputs (h reordered to the down GEMM's column order first) moved through
shared memory to rows of 8 consecutive columns per thread, stored 16 bytes at a time. Only compiled for CUDA
sm_90 (Gluon has no interpreter; wgmma is Hopper's): the mma kernel runs under TRITON_INTERPRET and on
other devices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dayzero.kernels.moe._common import kernel_activation
from dayzero.kernels.moe._dispatch import BlockList, combine, dispatch, split_blocks
from dayzero.kernels.moe.configs import WgmmaConfig

BLOCK_K = 64  # the K tile, and the block within which columns are permuted
BLOCK_N = 128  # weight rows per program (8 warps: two warp groups of 64 rows)
NUM_WARPS = 8


def physical_columns(block_k: int = BLOCK_K) -> torch.Tensor:
    """int64 [block_k]: the checkpoint column (within a 64-wide K tile) held at each logical column."""
    kl = torch.arange(block_k)
    h, wib1, blk = kl & 1, (kl >> 1) & 1, (kl >> 2) & 1
    j, wib0 = (kl >> 3) & 3, (kl >> 5) & 1
    return 8 * (4 * blk + 2 * wib1 + wib0) + j + 4 * h


@triton.jit
def _gather_permute_kernel(x_ptr, out_ptr, row_pair_ptr, S, stride_x, stride_o, K: tl.constexpr,
                           GATHER: tl.constexpr, TOP_K: tl.constexpr, ROWS: tl.constexpr, CB: tl.constexpr):
    """out[r, 64 b + kl] = x[token of row r, 64 b + physical_columns[kl]] for ROWS padded rows (program 0)
    and CB 64-column blocks (program 1): contiguous loads, the permutation done in registers, zeros past
    K; padding rows are not written (their GEMM columns are never read)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pair = tl.load(row_pair_ptr + r)
    valid = pair < S
    src_row = pair // TOP_K if GATHER else r
    c = tl.program_id(1) * (CB * 64) + tl.arange(0, CB * 64)
    v = tl.load(x_ptr + src_row.to(tl.int64)[:, None] * stride_x + c[None, :],
                mask=valid[:, None] & (c < K)[None, :], other=0.0)
    # physical column bits (high to low): blk, wib1, wib0, h, j1, j0; logical: wib0, j1, j0, blk, wib1, h
    v = tl.reshape(v, [ROWS, CB, 2, 2, 2, 2, 2, 2])
    v = tl.permute(v, (0, 1, 4, 6, 7, 2, 3, 5))
    v = tl.reshape(v, [ROWS, CB * 64])
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], v.to(out_ptr.dtype.element_ty),
             mask=valid[:, None])


def gather_permute(x: torch.Tensor, d, *, gather: bool) -> torch.Tensor:
    """bf16 [max_rows, Kp] (Kp = K rounded up to 64): the dispatched rows of x (gather: x[T, K] by token;
    else x is [max_rows, K] already in padded-row order) with each 64-column block permuted. Padding
    rows are left unwritten: each GEMM output row depends on its own input row only, and the rows of
    padding are never combined."""
    K = x.shape[1]
    KP = triton.cdiv(K, BLOCK_K) * BLOCK_K
    out = torch.empty(d.max_rows, KP, dtype=torch.bfloat16, device=x.device)
    rows = min(16, d.block_m)
    cb = 2 if KP % 128 == 0 else 1
    grid = (triton.cdiv(d.max_rows, rows), KP // (64 * cb))
    _gather_permute_kernel[grid](x, out, d.row_pair, d.pair_row.shape[0], x.stride(0), out.stride(0), K=K,
                                 GATHER=gather, TOP_K=d.top_k, ROWS=rows, CB=cb, num_warps=4)
    return out


# -- the Gluon GEMM ------------------------------------------------------------------------------

@gluon.constexpr_function
def _words_layout(num_warps, block_n):
    """Layout of the weight words [block_n, 2 (32-blocks), 4 (words in a block)] of one K tile: each
    thread holds the words whose codes its wgmma A fragment needs (module docstring)."""
    regs = [[0, 0, 1], [8, 0, 0]]
    rows = 16 * num_warps
    while rows < block_n:
        regs.append([rows, 0, 0])
        rows *= 2
    warps = [[16 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 0, 2], [0, 1, 0], [1, 0, 0], [2, 0, 0],
                                                                  [4, 0, 0]],
                                      warp_bases=warps, block_bases=[], shape=[block_n, 2, 4])


@gluon.jit
def _pair_bits(words, SHIFT: gl.constexpr):
    t = words >> SHIFT
    return ((t & 0x00070007) << 6) | ((t & 0x00080008) << 12)


@gluon.jit
def _scaled_halves(bits, f1, f2, HIGH_SCALES: gl.constexpr):
    """(low, high) bf16 of bits (two bf16) times the bf16x2 factors f1 (and f2)."""
    if HIGH_SCALES:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mul.rn.bf16x2 t, t, $4; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r", [bits, f1, f2], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r", [bits, f1], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)


@gluon.jit
def _upcast(words, scale, a_layout: gl.constexpr, BN: gl.constexpr, HIGH_SCALES: gl.constexpr):
    """bf16 [BN, 64] in the wgmma A-operand layout from words [BN, 2, 4] and E8M0 bytes [BN, 2]."""
    s = scale.to(gl.int32)
    low = gl.where(s != 255, (gl.minimum(s, 128) + 126) << 7, 0x7FC0)
    f1 = gl.expand_dims(low | (low << 16), 2)
    high = (gl.maximum(s, 128) - 1) << 7
    f2 = gl.expand_dims(high | (high << 16), 2)
    f1 = gl.broadcast(f1, words)[0]
    f2 = gl.broadcast(f2, words)[0]
    l0, h0 = _scaled_halves(_pair_bits(words, 0), f1, f2, HIGH_SCALES)
    l1, h1 = _scaled_halves(_pair_bits(words, 4), f1, f2, HIGH_SCALES)
    l2, h2 = _scaled_halves(_pair_bits(words, 8), f1, f2, HIGH_SCALES)
    l3, h3 = _scaled_halves(_pair_bits(words, 12), f1, f2, HIGH_SCALES)
    v = gl.join(gl.join(gl.join(l0, h0), gl.join(l1, h1)), gl.join(gl.join(l2, h2), gl.join(l3, h3)))
    # [BN, blk, wib, h, j0, j1] -> [BN, blk, wib1, wib0, h, j0, j1] -> logical column order
    v = gl.reshape(v, [BN, 2, 2, 2, 2, 2, 2])
    v = gl.permute(v, (0, 3, 6, 5, 1, 2, 4))
    v = gl.reshape(v, [BN, 64])
    return gl.convert_layout(v, a_layout, assert_trivial=True)


@gluon.jit
def _load_words(w_base, s_base, wrow, k0, K: gl.constexpr, stride_wn, stride_sn, words_layout: gl.constexpr):
    """int32 words [BN, 2, 4] and E8M0 bytes [BN, 2] of K tile k0 for weight rows wrow (zeros past K)."""
    s_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
    blk = gl.arange(0, 2, layout=gl.SliceLayout(0, s_layout))
    wib = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_layout)))
    kb = k0 // 32 + blk  # [2] 32-blocks of this tile
    kmask = kb < K // 32
    word = gl.expand_dims(gl.expand_dims(kb * 4, 0), 2) + gl.expand_dims(gl.expand_dims(wib, 0), 1)  # [1, 2, 4]
    rows3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(wrow, gl.SliceLayout(1, s_layout)), 1), 2)
    m3 = gl.expand_dims(gl.expand_dims(kmask, 0), 2)
    words = gl.load(w_base + rows3 * stride_wn + word, mask=m3 & (rows3 >= 0), other=0)
    rows2 = gl.expand_dims(gl.convert_layout(wrow, gl.SliceLayout(1, s_layout)), 1)
    scale = gl.load(s_base + rows2 * stride_sn + gl.expand_dims(kb, 0), mask=gl.expand_dims(kmask, 0) & (rows2 >= 0),
                    other=127)
    return words, scale


@gluon.jit
def _refill(x_desc, xs, bars, row0, nxt, num_k: gl.constexpr, STAGES: gl.constexpr, BK: gl.constexpr):
    """Start the TMA load of X tile nxt into its ring slot (whose previous tile's wgmma has retired)."""
    if nxt < num_k:
        ns = nxt % STAGES
        mbarrier.expect(bars.index(ns), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [row0, nxt * BK], bars.index(ns), xs.index(ns))


@gluon.jit
def _sigmoid(x):
    """1 / (1 + 2^(-x log2 e)) with the special-function unit's approximations (ex2, rcp: relative error
    about 2^-22, far below the bf16 rounding of the output); saturates to 0 and 1, NaN stays NaN."""
    return gl.inline_asm_elementwise(
        "{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; add.ftz.f32 t, t, 0f3F800000; "
        "rcp.approx.ftz.f32 $0, t; }", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _epilogue(acc, t0, row_end, n0, expert, bias_ptr, out_ptr, row_pair_ptr, router_weight_ptr, N, S, up_offset,
              alpha, limit, stride_be, stride_om, GATED: gl.constexpr, ACTIVATION: gl.constexpr,
              HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr, ROUTER_WEIGHT: gl.constexpr,
              PERMUTE_OUT: gl.constexpr, BN: gl.constexpr, OUT_N: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Rows t0.. of accumulator acc [BN, rows] (outputs n0..): biases, activation or router weight, the
    bf16 store (rows from row_end on are not stored)."""
    ROWS: gl.constexpr = acc.shape[1]
    if GATED:
        g = gl.reshape(acc, [BN // 16, 2, 8, ROWS])
        g = gl.permute(g, (0, 2, 3, 1))
        g = gl.reshape(g, [OUT_N, ROWS, 2])
        gate, up = gl.split(g)
        out_layout: gl.constexpr = gate.type.layout
        n = n0 + gl.arange(0, OUT_N, layout=gl.SliceLayout(1, out_layout))
        if HAS_BIAS:
            b_base = bias_ptr + expert.to(gl.int64) * stride_be
            gate = gate + gl.expand_dims(gl.load(b_base + n, mask=n < N, other=0.0).to(gl.float32), 1)
            up = up + gl.expand_dims(gl.load(b_base + up_offset + n, mask=n < N, other=0.0).to(gl.float32), 1)
        if ACTIVATION == 1:
            if HAS_LIMIT:
                gate = gl.minimum(gate, limit)
                up = gl.minimum(gl.maximum(up, -limit), limit)
            val = gate * _sigmoid(gate) * up
        else:
            gate = gl.minimum(gate, limit)
            up = gl.minimum(gl.maximum(up, -limit), limit)
            val = gate * _sigmoid(alpha * gate) * (up + 1.0)
        val = gl.where(gl.expand_dims(n < N, 1), val, 0.0)
    else:
        out_layout: gl.constexpr = acc.type.layout
        n = n0 + gl.arange(0, OUT_N, layout=gl.SliceLayout(1, out_layout))
        val = acc
        if HAS_BIAS:
            b_base = bias_ptr + expert.to(gl.int64) * stride_be
            val = val + gl.expand_dims(gl.load(b_base + n, mask=n < N, other=0.0).to(gl.float32), 1)
    if ROUTER_WEIGHT:  # one load per row by one thread, moved to the rows' layout through shared memory
        rows_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        tr = t0 + gl.arange(0, ROWS, layout=rows_layout)
        pair = gl.load(row_pair_ptr + tr, mask=tr < row_end, other=S)
        rw = gl.load(router_weight_ptr + pair, mask=pair < S, other=0.0).to(gl.float32)
        val = val * gl.expand_dims(gl.convert_layout(rw, gl.SliceLayout(0, out_layout)), 0)
    v = val.to(gl.bfloat16)
    if PERMUTE_OUT:
        # h for the down GEMM: each 64-block of columns in logical order (module docstring). Logical column
        # bits (b5..b0) of local output n are physical bits (b3 b1 b0 b5 b4 b2): reorder the 64 outputs so
        # that they run in physical order; zeros up to the 64-block (v is 0 past N).
        v = gl.reshape(gl.permute(gl.reshape(v, [2, 2, 2, 2, 2, 2, ROWS]), (2, 4, 5, 0, 1, 3, 6)), [OUT_N, ROWS])
        col_end = (N + 63) // 64 * 64
    else:
        col_end = N
    # Rows of 8 consecutive columns per thread (16-byte stores) through shared memory.
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (OUT_N // 8), OUT_N // 8], [NUM_WARPS, 1], [1, 0])
    v = gl.convert_layout(gl.permute(v, (1, 0)), store_layout)
    t = t0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
    col = n0 + gl.arange(0, OUT_N, layout=gl.SliceLayout(0, store_layout))
    ptrs = out_ptr + gl.expand_dims(t.to(gl.int64), 1) * stride_om + gl.expand_dims(col, 0)
    gl.store(ptrs, v, mask=gl.expand_dims(t < row_end, 1) & gl.expand_dims(col < col_end, 0))


@gluon.jit
def _wgmma_kernel(
    x_desc, w_ptr, s_ptr, bias_ptr, out_ptr, row_pair_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
    router_weight_ptr, N, S, E, num_blocks, up_offset, alpha, limit,
    stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    K: gl.constexpr, GATED: gl.constexpr, ACTIVATION: gl.constexpr, HAS_LIMIT: gl.constexpr,
    HAS_BIAS: gl.constexpr, ROUTER_WEIGHT: gl.constexpr, PERMUTE_OUT: gl.constexpr, HIGH_SCALES: gl.constexpr,
    BLOCK_T: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, PIPELINE: gl.constexpr,
    SCHEDULED: gl.constexpr, num_warps: gl.constexpr,
):
    BN: gl.constexpr = 128
    BK: gl.constexpr = 64
    OUT_N: gl.constexpr = BN // 2 if GATED else BN  # output columns per program
    pid = gl.program_id(0)
    num_n = gl.cdiv(N, OUT_N)
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = gl.minimum(num_blocks - first, GROUP_M)
    mb = first + (pid % per_group) % size
    nb = (pid % per_group) // size
    expert = gl.load(block_expert_ptr + mb)
    if expert < E:
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_T, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        words_layout: gl.constexpr = _words_layout(num_warps, BN)
        row_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, words_layout))

        # weight rows of the accumulator rows j: gated, j = 16 w + 8 u + q holds gate (u = 0) or up (u = 1)
        # row 8 w + q of this program's 64 outputs; else row j of its 128.
        j = gl.arange(0, BN, layout=row_layout)
        n0 = nb * OUT_N
        if GATED:
            n_local = (j // 16) * 8 + (j % 8)
            wrow = gl.where(n0 + n_local < N, n0 + n_local + ((j // 8) % 2) * up_offset, -1)
        else:
            wrow = gl.where(n0 + j < N, n0 + j, -1)
        w_base = w_ptr + expert.to(gl.int64) * stride_we
        s_base = s_ptr + expert.to(gl.int64) * stride_se

        xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, BK], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        num_k: gl.constexpr = (K + BK - 1) // BK
        if SCHEDULED:  # a BlockList entry: its first row, and the end of its expert's rows
            row0 = gl.load(block_row_ptr + mb)
            row_end = gl.load(block_end_ptr + mb)
        else:
            row0 = mb * BLOCK_T
            row_end = row0 + BLOCK_T
        for i in gl.static_range(STAGES - 1):
            _refill(x_desc, xs, bars, row0, i, num_k, STAGES, BK)

        words, scale = _load_words(w_base, s_base, wrow, 0, K, stride_wn, stride_sn, words_layout)
        acc = gl.zeros([BN, BLOCK_T], gl.float32, layout=mma_layout)
        # The A registers of an asynchronous wgmma must not change before the wait that retires it. In a
        # plain loop the upcast tile is one value, hence one PTX register set rewritten every iteration, so
        # with a wgmma left in flight the next upcast overwrote its operand (wrong products on the H200).
        # Without PIPELINE each wgmma is retired before the next upcast, so upcast and MMA overlap across
        # the programs an SM holds (BLOCK_T 128: 128 registers, two 8-warp programs per SM). PIPELINE: two
        # register sets (below).
        if PIPELINE:
            # Two register sets, the loop unrolled twice: a0 and a1 are distinct values (distinct PTX
            # registers), so one wgmma stays in flight while the other set is upcast. Each set goes
            # through the wait that retires its wgmma as a dependency, which keeps it live until then. An
            # odd tile count upcasts its first tile before the loop, and no wgmma is in flight when the
            # loop exits: with the odd tile after the loop instead, ptxas serialized every wgmma of the
            # kernel (C7513, "non wgmma instructions defining input registers ... pipeline stage").
            # The weight words are loaded two tiles ahead (wa: the next tile to upcast, wb: the one after).
            ODD: gl.constexpr = num_k % 2
            if ODD:
                a1 = _upcast(words, scale, a_layout, BN, HIGH_SCALES)
                wa, sa = _load_words(w_base, s_base, wrow, BK, K, stride_wn, stride_sn, words_layout)
                mbarrier.wait(bars.index(0), 0)
                acc = warpgroup_mma(a1, xs.index(0).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                _refill(x_desc, xs, bars, row0, STAGES - 1, num_k, STAGES, BK)  # the slot no tile used yet
            else:
                a1 = gl.zeros([BN, BK], gl.bfloat16, layout=a_layout)
                wa, sa = words, scale
            wb, sb = _load_words(w_base, s_base, wrow, (ODD + 1) * BK, K, stride_wn, stride_sn, words_layout)
            for m in range(num_k // 2):
                ki = 2 * m + ODD
                a0 = _upcast(wa, sa, a_layout, BN, HIGH_SCALES)
                wa, sa = _load_words(w_base, s_base, wrow, (ki + 2) * BK, K, stride_wn, stride_sn, words_layout)
                mbarrier.wait(bars.index(ki % STAGES), (ki // STAGES) & 1)
                acc = warpgroup_mma(a0, xs.index(ki % STAGES).permute((1, 0)), acc, is_async=True)
                acc, a1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a1))
                _refill(x_desc, xs, bars, row0, ki + STAGES - 1, num_k, STAGES, BK)
                a1 = _upcast(wb, sb, a_layout, BN, HIGH_SCALES)
                wb, sb = _load_words(w_base, s_base, wrow, (ki + 3) * BK, K, stride_wn, stride_sn, words_layout)
                mbarrier.wait(bars.index((ki + 1) % STAGES), ((ki + 1) // STAGES) & 1)
                acc = warpgroup_mma(a1, xs.index((ki + 1) % STAGES).permute((1, 0)), acc, is_async=True)
                acc, a0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a0))
                _refill(x_desc, xs, bars, row0, ki + STAGES, num_k, STAGES, BK)
            acc, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a1))
        else:
            for i in range(num_k):
                a = _upcast(words, scale, a_layout, BN, HIGH_SCALES)
                words, scale = _load_words(w_base, s_base, wrow, (i + 1) * BK, K, stride_wn, stride_sn, words_layout)
                st = i % STAGES
                mbarrier.wait(bars.index(st), (i // STAGES) & 1)
                acc = warpgroup_mma(a, xs.index(st).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _refill(x_desc, xs, bars, row0, i + STAGES - 1, num_k, STAGES, BK)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        _epilogue(acc, row0, row_end, n0, expert, bias_ptr, out_ptr, row_pair_ptr, router_weight_ptr, N, S, up_offset,
                  alpha, limit, stride_be, stride_om, GATED, ACTIVATION, HAS_LIMIT, HAS_BIAS, ROUTER_WEIGHT,
                  PERMUTE_OUT, BN, OUT_N, num_warps)


def wgmma_gemm(a_perm, w, scale, bias, d, *, out_features: int, activation: int = 0, alpha: float = 1.0,
               limit: float | None = None, router_weights=None, permute_out: bool, high_scales: bool = True,
               config: WgmmaConfig, blocks: BlockList | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One GEMM over the padded rows of dispatch d: a_perm bf16 [max_rows, Kp] from gather_permute (or the
    permuted h of the gate/up GEMM), w int32 words [E, N, K/8], scale uint8 [E, N, K/32]. Returns bf16
    [max_rows, out_features] (permute_out: [max_rows, out_features rounded up to 64], permuted for the
    next GEMM). blocks: run these blocks of config.block_t rows (_dispatch.split_blocks) instead of
    every block of d (whose block_m must then be config.block_t); out: write into this tensor."""
    if blocks is None and d.block_m != config.block_t:
        raise ValueError(f"wgmma_gemm: dispatch block_m {d.block_m} != config block_t {config.block_t}")
    if blocks is not None and config.block_t % d.block_m:
        raise ValueError(f"wgmma_gemm: block_t {config.block_t} is not a multiple of the dispatch block_m {d.block_m}")
    E, N_rows, KW = w.shape
    K = KW * 8
    cols = triton.cdiv(out_features, BLOCK_K) * BLOCK_K if permute_out else out_features
    if out is None:
        out = torch.empty(d.max_rows, cols, dtype=torch.bfloat16, device=a_perm.device)
    elif out.shape != (d.max_rows, cols) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"wgmma_gemm: out must be bf16 [{d.max_rows}, {cols}] with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)}")
    num_blocks = d.max_blocks if blocks is None else len(blocks)
    if d.max_rows == 0 or num_blocks == 0:
        return out
    bt = config.block_t
    layout = gl.NVMMASharedLayout.get_default_for([bt, BLOCK_K], gl.bfloat16)
    x_desc = TensorDescriptor(a_perm, list(a_perm.shape), list(a_perm.stride()), [bt, BLOCK_K], layout)
    gated = activation != 0
    out_n = BLOCK_N // 2 if gated else BLOCK_N
    S = d.pair_row.shape[0]
    dummy = d.pair_row
    grid = (num_blocks * triton.cdiv(out_features, out_n),)
    _wgmma_kernel[grid](
        x_desc, w, scale, bias if bias is not None else dummy, out, d.row_pair,
        d.block_expert if blocks is None else blocks.expert, dummy if blocks is None else blocks.row0,
        dummy if blocks is None else blocks.end, router_weights if router_weights is not None else dummy,
        out_features, S, E, num_blocks, out_features if gated else 0, float(alpha),
        float(limit) if limit is not None else 0.0,
        w.stride(0), w.stride(1), scale.stride(0), scale.stride(1), bias.stride(0) if bias is not None else 0,
        out.stride(0),
        K=K, GATED=gated, ACTIVATION=activation, HAS_LIMIT=limit is not None, HAS_BIAS=bias is not None,
        ROUTER_WEIGHT=router_weights is not None, PERMUTE_OUT=permute_out, HIGH_SCALES=high_scales,
        BLOCK_T=bt, STAGES=config.num_stages, GROUP_M=config.group_m, PIPELINE=config.pipeline,
        SCHEDULED=blocks is not None, num_warps=NUM_WARPS,
    )
    return out


# -- the layer ------------------------------------------------------------------------------------

def launches(topk_ids: torch.Tensor, num_experts: int, config: WgmmaConfig):
    """(dispatch, runs) for a layer call: runs is [(config, BlockList or None)], one GEMM launch each. With
    config.tail_blocks: rows dispatched in config.tail_rows-row blocks and split (_dispatch.split_blocks)
    into the big blocks at config.block_t rows and the tail blocks."""
    if not config.tail_blocks:
        return dispatch(topk_ids, num_experts, config.block_t), [(config, None)]
    d = dispatch(topk_ids, num_experts, config.tail_rows)
    main, tail = split_blocks(d, config.block_t // config.tail_rows, config.tail_blocks)
    return d, [(config, main), (WgmmaConfig(config.tail_rows, pipeline=config.pipeline), tail)]


def expert_gemms(xp, d, runs, w13, s13, w2, s2, b13, b2, activation, topk_weights, *, inter: int,
                 high_scales: bool = True) -> torch.Tensor:
    """Both GEMMs over the padded rows of launches()'s dispatch: y [max_rows, H], each row times its router
    weight (xp: gather_permute's output)."""
    act, alpha = kernel_activation(activation)
    h = y = None
    for cfg, blocks in runs:
        h = wgmma_gemm(xp, w13, s13, b13, d, out_features=inter, activation=act, alpha=alpha, limit=activation.limit,
                       permute_out=True, high_scales=high_scales, config=cfg, blocks=blocks, out=h)
    for cfg, blocks in runs:
        y = wgmma_gemm(h, w2, s2, b2, d, out_features=w2.shape[1], router_weights=topk_weights.contiguous().view(-1),
                       permute_out=False, high_scales=high_scales, config=cfg, blocks=blocks, out=y)
    return y


def moe_layer_wgmma(x, topk_ids, topk_weights, w13, s13, w2, s2, b13, b2, activation, *, inter: int,
                    config: WgmmaConfig, high_scales: bool = True) -> torch.Tensor:
    """dispatch -> gather + permute x -> gate/up GEMM (bias, activation, h permuted) -> down GEMM (bias,
    router weight) -> combine; arguments checked by _layer.py (MXFP4 words)."""
    d, runs = launches(topk_ids, w13.shape[0], config)
    xp = gather_permute(x, d, gather=True)
    y = expert_gemms(xp, d, runs, w13, s13, w2, s2, b13, b2, activation, topk_weights, inter=inter,
                     high_scales=high_scales)
    return combine(y, d, x.shape[0], x.dtype)
