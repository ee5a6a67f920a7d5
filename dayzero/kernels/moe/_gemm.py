"""The transposed grouped GEMM over dispatched rows, MXFP4 (upcast in registers, _common.py) or bf16
weights, with the SwiGLU activation, the biases and the router weights fused into its epilogue: the
"gemm" kernel of paths A and C (choose.py), and the tensor-core kernel wherever no other one runs (the
interpreter, devices without the Gluon kernels, between the decode and the prefill kernels' ranges).

Layouts (canonical, dayzero.ops.moe):
    x      bf16 [T, H], row-major
    w13    [E, 2I, H]  gate rows 0..I-1, up rows I..2I-1;  w2 [E, H, I]
           MXFP4: int32 words [E, N, K/8] and E8M0 bytes uint8 [E, N, K/32] (_common.py); bf16: [E, N, K].
    b13    [E, 2I], b2 [E, H], any float dtype (added in float32).
    h      bf16 [max_rows, I]  the activated intermediate of each padded row (dispatch order)
    y      bf16 [max_rows, H]  each padded row's expert output times its router weight

The kernel computes the transposed product, acc[BLOCK_N, BLOCK_M] = W[BLOCK_N, K] @ A[BLOCK_M, K]^T,
so that the weights, which are upcast in registers, are the left operand of the tensor-core MMA
(whose M side must be 64 rows) and the few tokens of a decode step are its narrow side (16 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.moe._common import (ACT_NONE, _act_tile, _activate, _block_rows, _mxfp4_decode, _mxfp4_load,
                                         interpreting)
from dayzero.kernels.moe.configs import GemmConfig


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


def grouped_gemm(a, w, scale, bias, d, *, out_features: int, gather: bool, activation: int = ACT_NONE,
                 alpha: float = 1.0, limit: float | None = None, router_weights=None,
                 config: GemmConfig) -> torch.Tensor:
    """Launch the kernel over the padded rows of dispatch `d`. a: x [T, K] (gather) or h [max_rows, K];
    w: int32 words [E, N, K/8] with scale uint8 [E, N, K/32] (MXFP4) or bf16 [E, N, K] with scale None.
    Returns bf16 [max_rows, out_features]. Shapes are checked by the caller (_layer.py)."""
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
