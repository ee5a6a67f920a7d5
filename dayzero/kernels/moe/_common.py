"""Triton helpers shared by the routed-expert GEMMs (_gemm.py, _mma.py): the exact MXFP4 upcast in
registers, the activation tile loads, the fused activation, and the kernels' activation codes.

MXFP4 upcast, by bit manipulation on 32-bit words (two codes per operation), no tables, no conversion
instructions: for codes i and i+4 of a word (16 bits apart), t = word >> 4i;
    bits = ((t & 0x00070007) << 6) | ((t & 0x00080008) << 12)
puts each code's exponent and mantissa bits at bf16 bits 8..6 and its sign at bit 15, in the low and
high halves: each half is the bf16 whose value is e2m1 * 2^-126 (codes 0 and 1, zero and 0.5, land
exactly on bf16 zero and the subnormal 2^-127). A bf16 multiply by 2^(scale - 1) then gives
e2m1 * 2^(scale - 127), exactly (the product is a power of two times a 2-bit mantissa). 2^(scale - 1)
is a bf16 only for scale bytes up to 128, so the factor is applied as 2^(min(s, 128) - 1) times
2^(max(s, 128) - 128) (1 for every trained checkpoint), two bf16x2 multiplies, without a branch.
Scale byte 0xFF (NaN) gives NaN, like the reference. Weight words: the canonical blocks uint8
[E, N, K/32, 16] read as int32 [E, N, K/8]: word w of a row holds the codes of k = 8w..8w+7, code
k = 8w + i in bits 4i..4i+3.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dayzero.kernels.devices import interpreted

ACT_NONE, ACT_SWIGLU, ACT_SWIGLU_CLAMPED = 0, 1, 2


def kernel_activation(activation) -> tuple[int, float]:
    """(the kernels' ACTIVATION code, alpha) of an ops.moe.Activation."""
    act = ACT_SWIGLU if activation.kind == "swiglu" else ACT_SWIGLU_CLAMPED
    return act, activation.alpha if activation.alpha is not None else 1.0


@triton.jit
def _e2m1_pair(words, SHIFT: tl.constexpr, INTERPRET: tl.constexpr):
    """int32 words -> (low, high): codes SHIFT/4 and SHIFT/4 + 4 of each word. Compiled: bf16 holding
    e2m1 * 2^-126 (two codes per integer operation). Interpreter: float32 holding e2m1 exactly (the
    interpreter cannot convert bf16 subnormals), decoded from the same bits."""
    t = words >> SHIFT
    if INTERPRET:
        low = _e2m1_float32(t & 0xF)
        high = _e2m1_float32((t >> 16) & 0xF)
    else:
        bits = ((t & 0x00070007) << 6) | ((t & 0x00080008) << 12)
        low = (bits & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        high = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return low, high


@triton.jit
def _e2m1_float32(code):
    """E2M1 code (int32 0..15) -> float32: exponent/mantissa bits placed with the exponent rebiased,
    0.5 (code 1) and 0 (code 0) set apart since they are E2M1's subnormals."""
    mag = code & 7
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 0x3F000000, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_load(w_ptr, s_ptr, offs_n, n_mask, k0, K: tl.constexpr, stride_wn, stride_sn, BLOCK_K: tl.constexpr):
    """The int32 words [BLOCK_N, BLOCK_K/32, 4] and E8M0 bytes [BLOCK_N, BLOCK_K/32] of one weight tile;
    zeros past K (also for k0 >= K: the prefetch runs two tiles ahead)."""
    KB: tl.constexpr = BLOCK_K // 32
    blk = k0 // 32 + tl.arange(0, KB)
    k_mask = blk < K // 32
    word = blk[:, None] * 4 + tl.arange(0, 4)[None, :]  # [KB, 4]
    words = tl.load(w_ptr + offs_n[:, None, None] * stride_wn + word[None, :, :],
                    mask=n_mask[:, None, None] & k_mask[None, :, None], other=0)
    scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + blk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=127)
    return words, scale


@triton.jit
def _mxfp4_decode(words, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """bf16 [BLOCK_N, BLOCK_K] from the words and E8M0 bytes of _mxfp4_load (float32 under the interpreter)."""
    scale = scale.to(tl.int32)
    # Codes k = 32*blk + 8*word + 4*h + 2*a + b: pair SHIFT = 4*(2a + b) gives h = 0 (low) and 1 (high).
    l0, h0 = _e2m1_pair(words, 0, INTERPRET)
    l1, h1 = _e2m1_pair(words, 4, INTERPRET)
    l2, h2 = _e2m1_pair(words, 8, INTERPRET)
    l3, h3 = _e2m1_pair(words, 12, INTERPRET)
    w = tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))
    # w: [BN, KB, 4, 2(h), 2(a), 2(b)]
    finite = scale != 255
    if INTERPRET:
        factor = tl.where(finite, scale << 23, 0x7FC00000).to(tl.float32, bitcast=True)  # 2^(scale-127)
        w = w * factor[:, :, None, None, None, None]
    else:
        # e2m1 * 2^-126 * 2^(min(s,128) - 1) * 2^(max(s,128) - 128): two exact bf16 multiplies (the
        # second is by 1 unless the scale byte exceeds 128), no branch, NaN for s = 0xFF.
        low = tl.where(finite, (tl.minimum(scale, 128) + 126) << 7, 0x7FC0).to(tl.int16).to(tl.bfloat16, bitcast=True)
        high = ((tl.maximum(scale, 128) - 1) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        w = w * low[:, :, None, None, None, None] * high[:, :, None, None, None, None]
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _act_tile(a_base, offs_k, row_valid, K: tl.constexpr, EVEN_K: tl.constexpr):
    """Activation rows [BLOCK_M, BLOCK_K] at columns offs_k (a_base: per-row pointers [BLOCK_M, 1]);
    zero for invalid rows and past K."""
    if EVEN_K:
        return tl.load(a_base + offs_k[None, :], mask=row_valid[:, None], other=0.0)
    return tl.load(a_base + offs_k[None, :], mask=row_valid[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """float32 act(gate, up). ACT_SWIGLU: silu(gate) * up, with HAS_LIMIT gate clamped above and up
    to [-limit, limit] (DeepSeek-V4 swiglu_limit). ACT_SWIGLU_CLAMPED (gpt-oss): both clamped so, then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    if ACTIVATION == 1:
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    return out


@triton.jit
def _block_rows(mb, row_pair_ptr, a_ptr, S, stride_am, GATHER: tl.constexpr, TOP_K: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """The padded rows of dispatch block mb, the pair each holds, which are real, and the A row pointers:
    x rows by token (pair // TOP_K) with GATHER, else the padded rows themselves (h)."""
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair_ptr + rows)
    row_valid = pair < S
    if GATHER:
        a_rows = tl.where(row_valid, pair // TOP_K, 0)
    else:
        a_rows = rows
    return rows, pair, row_valid, a_ptr + a_rows.to(tl.int64)[:, None] * stride_am


def interpreting() -> bool:
    """True under Triton's CPU interpreter (the kernels then take their INTERPRET branches)."""
    return interpreted()
