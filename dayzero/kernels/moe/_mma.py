"""Grouped GEMM for many rows per expert (prefill), the "mma" kernel of paths A and C: tokens x weights on
the tensor cores, in the usual orientation acc[BLOCK_M rows, BLOCK_N outputs] = A[BLOCK_M, K] @
W[BLOCK_N, K]^T, over the padded rows of a dispatch (_dispatch.py), with the transposed GEMM's fused
epilogue (biases, SwiGLU variants, router weights) and the same inputs and outputs (`mma_gemm` keeps
_gemm.grouped_gemm's contract).

Why a second kernel: _gemm.py computes the transposed product so that a decode step's few rows are the
narrow side of the MMA; with hundreds of rows per expert that orientation keeps the weights in the MMA's
register operand and its tiles small (BLOCK_N 64 weight rows per program, BLOCK_K 64). Here a program
owns 64-256 rows x 64-256 outputs, the activation tiles stream through shared memory by the compiler's
software pipeline (num_stages), and the weight tile is the MMA's shared-memory operand: 1.5-1.9x the
transposed GEMM from 512 to 8192 tokens.

Where the MXFP4 variant's time goes: about 500 instructions per thread per K step for 64 upcast values,
230 of them integer ops at half rate; the bf16 tile is written to shared memory for the MMA, each scale
tile changes register layout through shared memory (barriers), and every wgmma is waited for before the
next tile's upcast (Triton pipelines only operands loaded straight from memory), so the upcast and the
MMA overlap only across the two programs an SM holds. On sm_90 the Gluon kernel (_wgmma.py) removes
that; this kernel stays for bf16 weights, other devices and the interpreter.

Weight formats (`WFMT`):
    WFMT_BF16   bf16 [E, N, K] (path C).
    WFMT_MXFP4  canonical MXFP4 read as int32 words [E, N, K/8] + E8M0 bytes [E, N, K/32], upcast in
                registers by _common.py's bit manipulation (exact), prefetched one tile ahead by hand.
                Compiled with the word stride's alignment unspecialised: with it, Triton 3.6 fails
                ("Illegal shared layout" in TritonGPUOptimizeDotOperands) at both models' shapes.

Program order: one flat grid over (block, N tile), grouped GROUP_M blocks at a time (all N tiles of
GROUP_M consecutive blocks run together), so a block's gathered activation rows and an expert's
weight tiles are reused from L2 instead of re-read from HBM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.moe._common import _act_tile, _activate, _block_rows, _mxfp4_decode, _mxfp4_load, interpreting
from dayzero.kernels.moe.configs import MmaConfig

WFMT_BF16, WFMT_MXFP4 = 0, 1


@triton.jit
def _bf16_tile(w_base, offs_n, k0, K: tl.constexpr, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               INTERPRET: tl.constexpr):
    """bf16 weights [BLOCK_N, BLOCK_K] of rows offs_n (always in range) at K offset k0; zero past K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :]
    if EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=(offs_k < K)[None, :], other=0.0)
    w = w.to(tl.bfloat16)
    if INTERPRET:  # the interpreter holds bf16 as raw bits: its dot cannot take them
        w = w.to(tl.float32)
    return w


def _moe_mma_body(
    a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, row_pair_ptr, block_expert_ptr, router_weight_ptr,
    N, S, E, num_blocks, up_offset, alpha, limit,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    K: tl.constexpr, WFMT: tl.constexpr, GATHER: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTER_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One [BLOCK_M padded rows x BLOCK_N outputs] tile of one expert (module docstring); with
    ACTIVATION, gate rows n and up rows up_offset + n, stored as act(gate, up)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    mb = first + (pid % per_group) % size
    nb = (pid % per_group) // size
    expert = tl.load(block_expert_ptr + mb)
    if expert >= E:
        return
    rows, pair, row_valid, a_base = _block_rows(mb, row_pair_ptr, a_ptr, S, stride_am, GATHER, TOP_K, BLOCK_M)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    ld_n = offs_n % N  # rows past N re-read row n - N (in range, never stored): no masks in the loop
    ld_up = ld_n + up_offset
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    GATED: tl.constexpr = ACTIVATION != 0
    HAND: tl.constexpr = WFMT == 1

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAND:  # upcast tiles are not pipelined by the compiler: the next tile's words are loaded first
        gw, gs = _mxfp4_load(w_base, s_base, ld_n, ld_n >= 0, 0, K, stride_wn, stride_sn, BLOCK_K)
        if GATED:
            uw, us = _mxfp4_load(w_base, s_base, ld_up, ld_n >= 0, 0, K, stride_wn, stride_sn, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _act_tile(a_base, offs_k, row_valid, K, EVEN_K)
        if INTERPRET:
            a = a.to(tl.float32)
        if HAND:
            nw, ns = _mxfp4_load(w_base, s_base, ld_n, ld_n >= 0, k0 + BLOCK_K, K, stride_wn, stride_sn, BLOCK_K)
            acc = tl.dot(a, tl.trans(_mxfp4_decode(gw, gs, BLOCK_N, BLOCK_K, INTERPRET)), acc)
            gw, gs = nw, ns
            if GATED:
                nw, ns = _mxfp4_load(w_base, s_base, ld_up, ld_n >= 0, k0 + BLOCK_K, K, stride_wn, stride_sn,
                                     BLOCK_K)
                acc_up = tl.dot(a, tl.trans(_mxfp4_decode(uw, us, BLOCK_N, BLOCK_K, INTERPRET)), acc_up)
                uw, us = nw, ns
        else:
            w = _bf16_tile(w_base, ld_n, k0, K, stride_wn, BLOCK_K, EVEN_K, INTERPRET)
            acc = tl.dot(a, tl.trans(w), acc)
            if GATED:
                w = _bf16_tile(w_base, ld_up, k0, K, stride_wn, BLOCK_K, EVEN_K, INTERPRET)
                acc_up = tl.dot(a, tl.trans(w), acc_up)

    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_base + ld_n).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_base + ld_up).to(tl.float32)[None, :]
    if GATED:
        acc = _activate(acc, acc_up, alpha, limit, ACTIVATION, HAS_LIMIT)
    if ROUTER_WEIGHT:
        rw = tl.load(router_weight_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


# Two compilations of one body. bf16 weights need the row stride's 16-divisibility (16-byte cp.async
# of the weight tiles: without it the H200 measured the bf16 layer 2.4x slower); for MXFP4 words
# Triton 3.6 fails to compile with it (module docstring), so that alignment is not specialised there.
_mma_kernel = triton.jit(_moe_mma_body)
_mma_kernel_words = triton.jit(_moe_mma_body, do_not_specialize_on_alignment=["stride_wn"])


def mma_gemm(a, w, scale, bias, d, *, out_features: int, gather: bool, activation: int = 0, alpha: float = 1.0,
             limit: float | None = None, router_weights=None, config: MmaConfig) -> torch.Tensor:
    """_gemm.grouped_gemm's contract on this kernel: a x [T, K] (gather) or h [max_rows, K]; w int32
    words [E, N, K/8] with scale uint8 [E, N, K/32] (MXFP4) or bf16 [E, N, K] with scale None. Returns
    bf16 [max_rows, out_features]. d.block_m must equal config.block_m; shapes checked by the callers."""
    if d.block_m != config.block_m:
        raise ValueError(f"mma_gemm: dispatch block_m {d.block_m} != config block_m {config.block_m}")
    mxfp4 = scale is not None
    K = a.shape[1]
    E = w.shape[0]
    out = torch.empty(d.max_rows, out_features, dtype=torch.bfloat16, device=a.device)
    if d.max_rows == 0:
        return out
    wfmt = WFMT_MXFP4 if mxfp4 else WFMT_BF16
    S = d.pair_row.shape[0]
    dummy = d.pair_row  # stands in for absent optional pointers (never read)
    num_blocks = d.max_blocks
    grid = (num_blocks * triton.cdiv(out_features, config.block_n),)
    kernel = _mma_kernel_words if wfmt == WFMT_MXFP4 else _mma_kernel
    kernel[grid](
        a, w, scale if mxfp4 else dummy, bias if bias is not None else dummy, out, d.row_pair, d.block_expert,
        router_weights if router_weights is not None else dummy,
        out_features, S, E, num_blocks, out_features if activation else 0, float(alpha),
        float(limit) if limit is not None else 0.0,
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0) if mxfp4 else 0, scale.stride(1) if mxfp4 else 0,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        K=K, WFMT=wfmt, GATHER=gather, TOP_K=d.top_k, ACTIVATION=activation, HAS_LIMIT=limit is not None,
        HAS_BIAS=bias is not None, ROUTER_WEIGHT=router_weights is not None, EVEN_K=K % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        INTERPRET=interpreting(), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
