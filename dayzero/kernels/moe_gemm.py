"""Grouped GEMM over dispatched rows, weights in MXFP4 (upcast in registers) or BF16, with the
SwiGLU activation, the biases and the router weights fused into its epilogue; and the routed-expert
layer built from it: dispatch -> gate/up GEMM + activation -> down GEMM x router weight -> combine.

Layouts (canonical, dayzero.ops.moe):
    x      bf16 [T, H], row-major
    w13    [E, 2I, H]  gate rows 0..I-1, up rows I..2I-1;  w2 [E, H, I]
           MXFP4: blocks uint8 [E, N, K/32, 16] (read here as int32 words [E, N, K/8]: word w of a
           row holds the E2M1 codes of k = 8w..8w+7, code k=8w+i in bits 4i..4i+3), scales uint8
           [E, N, K/32], one E8M0 byte per 32 values of K.   BF16: [E, N, K].
    b13    [E, 2I], b2 [E, H], any float dtype (added in float32).
    h      bf16 [max_rows, I]  the activated intermediate of each padded row (dispatch order)
    y      bf16 [max_rows, H]  each padded row's expert output times its router weight

The kernel computes the transposed product, acc[BLOCK_N, BLOCK_M] = W[BLOCK_N, K] @ A[BLOCK_M, K]^T,
so that the weights, which are upcast in registers, are the left operand of the tensor-core MMA
(whose M side must be 64 rows) and the few tokens of a decode step are its narrow side (16 rows).

MXFP4 upcast, by bit manipulation on 32-bit words (two codes per operation), no tables, no conversion
instructions: for codes i and i+4 of a word (16 bits apart), t = word >> 4i;
    bits = ((t & 0x00070007) << 6) | ((t & 0x00080008) << 12)
puts each code's exponent and mantissa bits at bf16 bits 8..6 and its sign at bit 15, in the low and
high halves: each half is the bf16 whose value is e2m1 * 2^-126 (codes 0 and 1, zero and 0.5, land
exactly on bf16 zero and the subnormal 2^-127). A bf16 multiply by 2^(scale - 1) then gives
e2m1 * 2^(scale - 127), exactly (the product is a power of two times a 2-bit mantissa). 2^(scale - 1)
is a bf16 only for scale bytes up to 128, so the factor is applied as 2^(min(s, 128) - 1) times
2^(max(s, 128) - 128) (1 for every trained checkpoint), two bf16x2 multiplies, without a branch.
Scale byte 0xFF (NaN) gives NaN, like the reference.

At decode token counts (few rows per active expert) moe_layer hands MXFP4 layers to moe_decode, whose
kernels multiply int8-quantized activations with the E2M1 codes by dp4a instead of tensor-core MMAs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


ACT_NONE, ACT_SWIGLU, ACT_SWIGLU_CLAMPED = 0, 1, 2


def kernel_activation(activation) -> tuple[int, float]:
    """(the kernels' ACTIVATION code, alpha) of an ops.moe.Activation."""
    act = ACT_SWIGLU if activation.kind == "swiglu" else ACT_SWIGLU_CLAMPED
    return act, activation.alpha if activation.alpha is not None else 1.0


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1, read when Triton was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


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
def _bf16_tile(w_ptr, offs_n, n_mask, k0, K: tl.constexpr, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               INTERPRET: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    if EVEN_K:
        w = tl.load(ptrs, mask=n_mask[:, None], other=0.0)
    else:
        w = tl.load(ptrs, mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    w = w.to(tl.bfloat16)
    if INTERPRET:  # the interpreter holds bf16 as raw uint16 bits: its dot cannot take them
        w = w.to(tl.float32)
    return w


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


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, row_pair_ptr, block_expert_ptr, router_weight_ptr,
    N, S, E, up_offset, alpha, limit,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    K: tl.constexpr, MXFP4: tl.constexpr, GATHER: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTER_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One [BLOCK_M rows x BLOCK_N outputs] tile of one expert. Rows: padded rows of block
    program_id(0); GATHER reads A row row_pair // TOP_K (x by token), else A row = padded row (h).
    With ACTIVATION, the tile computes gate rows n and up rows up_offset + n and stores act(gate, up)."""
    mb = tl.program_id(0)
    expert = tl.load(block_expert_ptr + mb)
    if expert >= E:
        return
    nb = tl.program_id(1)
    rows, pair, row_valid, a_base = _block_rows(mb, row_pair_ptr, a_ptr, S, stride_am, GATHER, TOP_K, BLOCK_M)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    GATED: tl.constexpr = ACTIVATION != 0

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    offs_up = offs_n + up_offset
    # MXFP4 tiles are upcast in registers, so the compiler does not pipeline their loads: prefetch them
    # by hand, two tiles ahead (t0 = this iteration's tile, t1 = the next), gate (g) and up (u) rows.
    if MXFP4:
        g0w, g0s = _mxfp4_load(w_base, s_base, offs_n, n_mask, 0, K, stride_wn, stride_sn, BLOCK_K)
        g1w, g1s = _mxfp4_load(w_base, s_base, offs_n, n_mask, BLOCK_K, K, stride_wn, stride_sn, BLOCK_K)
        if GATED:
            u0w, u0s = _mxfp4_load(w_base, s_base, offs_up, n_mask, 0, K, stride_wn, stride_sn, BLOCK_K)
            u1w, u1s = _mxfp4_load(w_base, s_base, offs_up, n_mask, BLOCK_K, K, stride_wn, stride_sn, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _act_tile(a_base, offs_k, row_valid, K, EVEN_K)
        a_t = tl.trans(a)
        if INTERPRET:
            a_t = a_t.to(tl.float32)
        if MXFP4:
            gw, gs = g0w, g0s
            g0w, g0s = g1w, g1s
            g1w, g1s = _mxfp4_load(w_base, s_base, offs_n, n_mask, k0 + 2 * BLOCK_K, K, stride_wn, stride_sn, BLOCK_K)
            if GATED:
                uw, us = u0w, u0s
                u0w, u0s = u1w, u1s
                u1w, u1s = _mxfp4_load(w_base, s_base, offs_up, n_mask, k0 + 2 * BLOCK_K, K, stride_wn, stride_sn,
                                       BLOCK_K)
            w = _mxfp4_decode(gw, gs, BLOCK_N, BLOCK_K, INTERPRET)
            acc = tl.dot(w, a_t, acc)
            if GATED:
                acc_up = tl.dot(_mxfp4_decode(uw, us, BLOCK_N, BLOCK_K, INTERPRET), a_t, acc_up)
        else:
            acc = tl.dot(_bf16_tile(w_base, offs_n, n_mask, k0, K, stride_wn, BLOCK_K, EVEN_K, INTERPRET), a_t, acc)
            if GATED:
                acc_up = tl.dot(_bf16_tile(w_base, offs_up, n_mask, k0, K, stride_wn, BLOCK_K, EVEN_K, INTERPRET),
                                a_t, acc_up)

    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_base + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_up += tl.load(b_base + up_offset + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if GATED:
        acc = _activate(acc, acc_up, alpha, limit, ACTIVATION, HAS_LIMIT)
    if ROUTER_WEIGHT:
        rw = tl.load(router_weight_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
        acc = acc * rw[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, tl.trans(acc).to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


def choose_config(num_pairs: int, num_experts: int, n: int, mxfp4: bool, gated: bool) -> GemmConfig:
    """Tile sizes from the static sizes alone (no host synchronisation): BLOCK_M from the average rows
    per active expert, BLOCK_N small enough that a decode step still has ~2 tiles per SM."""
    active = max(1, min(num_experts, num_pairs))
    rows = num_pairs / active
    if rows <= 24:
        block_m = 16
    elif rows <= 48:
        block_m = 32
    elif rows <= 96:
        block_m = 64
    else:
        block_m = 128
    if block_m <= 32:  # decode: weight-bandwidth bound; many CTAs, large K steps for bytes in flight
        block_n = 64 if active * triton.cdiv(n, 64) >= 264 else 32
        block_k = 256 if mxfp4 and block_m == 16 and (block_n == 32 or not gated) else 128 if mxfp4 else 64
        return GemmConfig(block_m, block_n, block_k, num_warps=4, num_stages=4)
    # Larger tiles: BLOCK_K 64 keeps the upcast tiles and both gated accumulators in registers (no spills).
    if block_m == 64:
        return GemmConfig(block_m, 128, 64, num_warps=8, num_stages=3)
    return GemmConfig(block_m, 64 if gated else 128, 64, num_warps=8, num_stages=3)


def grouped_gemm(a, w, scale, bias, d, *, out_features: int, gather: bool, activation: int = ACT_NONE,
                 alpha: float = 1.0, limit: float | None = None, router_weights=None,
                 config: GemmConfig) -> torch.Tensor:
    """Launch the kernel over the padded rows of dispatch `d`. a: x [T, K] (gather) or h [max_rows, K];
    w: int32 words [E, N, K/8] with scale uint8 [E, N, K/32] (MXFP4) or bf16 [E, N, K] with scale None.
    Returns bf16 [max_rows, out_features]. Shapes are checked by the callers (moe_mxfp4 / moe_bf16)."""
    mxfp4 = scale is not None
    K = a.shape[1]
    E = w.shape[0]
    out = torch.empty(d.max_rows, out_features, dtype=torch.bfloat16, device=a.device)
    if d.max_rows == 0:
        return out
    S = d.pair_row.shape[0]
    dummy = d.pair_row  # stands in for absent optional pointers (never read)
    grid = (d.max_blocks, triton.cdiv(out_features, config.block_n))
    _moe_gemm_kernel[grid](
        a, w, scale if mxfp4 else dummy, bias if bias is not None else dummy, out, d.row_pair, d.block_expert,
        router_weights if router_weights is not None else dummy,
        out_features, S, E, out_features if activation else 0, float(alpha),
        float(limit) if limit is not None else 0.0,
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0) if mxfp4 else 0, scale.stride(1) if mxfp4 else 0,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        K=K, MXFP4=mxfp4, GATHER=gather, TOP_K=d.top_k, ACTIVATION=activation, HAS_LIMIT=limit is not None,
        HAS_BIAS=bias is not None, ROUTER_WEIGHT=router_weights is not None, EVEN_K=K % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, INTERPRET=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


# -- the routed-expert layer ---------------------------------------------------------------------

def moe_layer(x, topk_ids, topk_weights, w13, s13, w2, s2, b13, b2, activation, *, inter: int,
              configs=None, high_scales=True, normal_scales=False) -> torch.Tensor:
    """dispatch -> gate/up GEMM with fused bias + activation -> down GEMM with bias x router weight ->
    combine. Arguments already checked; w13/w2 as grouped_gemm takes them. configs: a (GemmConfig,
    GemmConfig) pair (this module's transposed tensor-core GEMM), a (MmaConfig, MmaConfig) pair
    (moe_mma's prefill GEMM), a moe_decode.DecodeConfig (MXFP4 only: the integer-dot decode kernels),
    a moe_wgmma.WgmmaConfig (MXFP4, sm_90: the Gluon prefill kernel), or None to choose from the static
    sizes (MXFP4: the decode kernels when moe_decode.choose_decode_config returns a config, with its
    DECODE_MAX_ROWS_WGMMA threshold on sm_90, where moe_wgmma runs everything above; elsewhere moe_mma
    when choose_mma_configs returns configs, else this module's kernel). high_scales:
    whether an E8M0 byte may exceed 128 (moe_wgmma), a bool or a callable asked only when moe_wgmma runs;
    normal_scales: whether every E8M0 byte lies in 1..254 (the decode kernels' one-shift factor), a bool or
    a callable asked only when the decode kernels run."""
    from dayzero.kernels.moe_dispatch import combine, dispatch

    T, H = x.shape
    E = w13.shape[0]
    if T == 0:
        return torch.zeros_like(x)
    mxfp4 = s13 is not None
    pairs = topk_ids.numel()
    from dayzero.kernels import moe_wgmma

    wgmma = mxfp4 and moe_wgmma.available(x)
    if mxfp4 and not isinstance(configs, (tuple, moe_wgmma.WgmmaConfig)):
        from dayzero.kernels.moe_decode import (DECODE_MAX_ROWS_PER_EXPERT, DECODE_MAX_ROWS_WGMMA,
                                                choose_decode_config, moe_layer_decode)

        from dayzero.kernels.devices import sm_count

        sms = sm_count(x.device) if x.is_cuda else 132
        from dayzero.kernels.moe_decode_sm90 import available as gluon_available

        decode = configs or choose_decode_config(T, pairs, E, H, inter, sms,
                                                 DECODE_MAX_ROWS_WGMMA if wgmma else DECODE_MAX_ROWS_PER_EXPERT,
                                                 gluon=x.is_cuda and gluon_available(x.device))
        if decode is not None:
            normal = normal_scales() if callable(normal_scales) else normal_scales
            return moe_layer_decode(x, topk_ids, topk_weights, w13, s13, w2, s2, b13, b2, activation, inter=inter,
                                    config=decode, normal_scales=normal)
    if mxfp4 and (isinstance(configs, moe_wgmma.WgmmaConfig) or configs is None and wgmma):
        wg = configs or moe_wgmma.choose_wgmma_config(pairs, E)
        high = high_scales() if callable(high_scales) else high_scales
        return moe_wgmma.moe_layer_wgmma(x, topk_ids, topk_weights, w13, s13, w2, s2, b13, b2, activation,
                                         inter=inter, config=wg, high_scales=high)
    from dayzero.kernels.moe_mma import MmaConfig, choose_mma_configs, mma_gemm

    c1, c2 = configs or choose_mma_configs(pairs, E, mxfp4, inter, H) or (choose_config(pairs, E, inter, mxfp4, True),
                                                                 choose_config(pairs, E, H, mxfp4, False))
    if c1.block_m != c2.block_m:
        raise ValueError(f"moe_layer: both GEMMs must use one BLOCK_M, got {c1.block_m} and {c2.block_m}")
    if isinstance(c1, MmaConfig) != isinstance(c2, MmaConfig):
        raise ValueError("moe_layer: both GEMMs must be GemmConfig or both MmaConfig")
    gemm = mma_gemm if isinstance(c1, MmaConfig) else grouped_gemm
    d = dispatch(topk_ids, E, c1.block_m)
    act, alpha = kernel_activation(activation)
    h = gemm(x, w13, s13, b13, d, out_features=inter, gather=True, activation=act, alpha=alpha,
             limit=activation.limit, config=c1)
    y = gemm(h, w2, s2, b2, d, out_features=H, gather=False, router_weights=topk_weights.contiguous().view(-1),
             config=c2)
    return combine(y, d, T, x.dtype)
