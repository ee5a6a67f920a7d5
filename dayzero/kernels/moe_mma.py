"""Grouped GEMM for many rows per expert (prefill): tokens x weights on the tensor cores, in the usual
orientation acc[BLOCK_M rows, BLOCK_N outputs] = A[BLOCK_M, K] @ W[BLOCK_N, K]^T, over the padded rows
of a dispatch (moe_dispatch), with the same fused epilogue as moe_gemm (biases, SwiGLU variants,
router weights) and the same inputs and outputs, so `moe_gemm.moe_layer` can run either.

Why a second kernel: moe_gemm computes the transposed product so that a decode step's few rows are
the narrow side of the MMA; with hundreds of rows per expert that orientation keeps the weights in
the MMA's register operand and its tiles small (BLOCK_N 64 weight rows per program, BLOCK_K 64),
and the H200 measured it at 19% of the bf16 matmul rate at 8192 tokens (BENCHMARKS.md, 2026-11-30).
Here a program owns 64-256 rows x 64-256 outputs, the activation tiles stream through shared memory
by the compiler's software pipeline (num_stages), and the weight tile is the MMA's shared-memory
operand. Measured on the H200 (2026-12-01, BENCHMARKS.md): bf16 weights 470 TFLOP/s at 8192 tokens on
gpt-oss-120b shapes (62% of the bf16 matmul rate; moe_gemm 350), MXFP4 250 TFLOP/s (33%; moe_gemm 146).

Where the MXFP4 variant's time goes (SASS of the gated 128 x 64 x 64 / 4-warp tile, compiled for
sm_90 from this machine): about 500 instructions per thread per K step for 64 upcast values, 230 of
them integer ops at half rate; the bf16 tile is written to shared memory for the MMA, each scale
tile changes register layout through shared memory (barriers), and every wgmma is waited for before
the next tile's upcast (Triton pipelines only operands loaded straight from memory), so the upcast
and the MMA overlap only across the two programs an SM holds. Next: a producer warpgroup upcasting
into a shared-memory ring for consumer warpgroups (warp specialisation).

On sm_90 the MXFP4 layers run moe_wgmma (Gluon) instead, 1.5x faster (BENCHMARKS.md, third 2026-12-01
run); this kernel stays for bf16 weights, other devices, the interpreter and DAYZERO_MOE_WGMMA=0.

Weight formats (`WFMT`):
    WFMT_BF16   bf16 [E, N, K] (path C).
    WFMT_MXFP4  canonical MXFP4 read as int32 words [E, N, K/8] + E8M0 bytes [E, N, K/32], upcast in
                registers by moe_gemm's bit manipulation (exact), prefetched one tile ahead by hand.
                Compiled with the word stride's alignment unspecialised: with it, Triton 3.6 fails
                ("Illegal shared layout" in TritonGPUOptimizeDotOperands) at both models' shapes.
    WFMT_SCALED the same bytes read as uint8 [E, N, K/2] and handed to `tl.dot_scaled` (bf16 x e2m1
                with E8M0 scales), whose upcast Triton lowers itself. Compiled only: Triton's
                interpreter has no dot_scaled, so under it `mma_gemm` runs WFMT_MXFP4 instead.

Program order: one flat grid over (block, N tile), grouped GROUP_M blocks at a time (all N tiles of
GROUP_M consecutive blocks run together), so a block's gathered activation rows and an expert's
weight tiles are reused from L2 instead of re-read from HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dayzero.kernels.moe_gemm import _act_tile, _activate, _block_rows, _mxfp4_decode, _mxfp4_load, interpreting

WFMT_BF16, WFMT_MXFP4, WFMT_SCALED = 0, 1, 2


@dataclass(frozen=True)
class MmaConfig:
    """Tiles of the prefill GEMM. block_n is per accumulator (the gated GEMM holds two: gate and up)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    scaled: bool = False  # MXFP4 through tl.dot_scaled instead of the hand upcast


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


@triton.jit
def _scaled_tile(w_base, s_base, offs_n, k0, K: tl.constexpr, stride_wn, stride_sn, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """Packed E2M1 bytes [BLOCK_N, BLOCK_K/2] and E8M0 bytes [BLOCK_N, BLOCK_K/32] for tl.dot_scaled."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_s = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    if EVEN_K:
        codes = tl.load(w_base + offs_n[:, None] * stride_wn + offs_b[None, :])
        scale = tl.load(s_base + offs_n[:, None] * stride_sn + offs_s[None, :])
    else:
        codes = tl.load(w_base + offs_n[:, None] * stride_wn + offs_b[None, :], mask=(offs_b < K // 2)[None, :],
                        other=0)
        scale = tl.load(s_base + offs_n[:, None] * stride_sn + offs_s[None, :], mask=(offs_s < K // 32)[None, :],
                        other=127)
    return codes, scale


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
        elif WFMT == 2:
            codes, scale = _scaled_tile(w_base, s_base, ld_n, k0, K, stride_wn, stride_sn, BLOCK_K, EVEN_K)
            acc = tl.dot_scaled(a, None, "bf16", tl.trans(codes), scale, "e2m1", acc)
            if GATED:
                codes, scale = _scaled_tile(w_base, s_base, ld_up, k0, K, stride_wn, stride_sn, BLOCK_K, EVEN_K)
                acc_up = tl.dot_scaled(a, None, "bf16", tl.trans(codes), scale, "e2m1", acc_up)
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
    """moe_gemm.grouped_gemm's contract on this kernel: a x [T, K] (gather) or h [max_rows, K]; w int32
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
    wfmt = WFMT_BF16
    if mxfp4:
        wfmt = WFMT_SCALED if config.scaled and not interpreting() else WFMT_MXFP4
        if wfmt == WFMT_SCALED:
            w = w.view(torch.uint8).view(E, w.shape[1], K // 2)
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


def choose_mma_configs(num_pairs: int, num_experts: int, mxfp4: bool, inter: int,
                       hidden: int) -> tuple[MmaConfig, MmaConfig] | None:
    """(gate/up, down) tiles for this kernel from the static sizes alone (no host synchronisation), or
    None where moe_gemm's transposed kernel is kept (few rows per active expert). From the H200 sweep
    of bench/moe_prefill.py (2026-12-01, docs/kernels.md), r = expected rows per active expert:
    MXFP4: the weight upcast bounds the kernel, so BLOCK_M follows the rows (less upcast per row, little
    padding): 64 up to r = 96 (BLOCK_N 128 where N is a multiple of 128, else 64), 128 up to 160,
    256 up to 224 (DeepSeek-V4 at 8192 tokens, r = 192), 128 beyond (gpt-oss at 8192, r = 256: 256
    would pad half the experts to 512 rows). Measured faster than moe_gemm from r = 12 (512 tokens);
    below r = 8 moe_gemm stays. bf16 (path C): 128 x 128 tiles, 8 warps, 4 stages; the down GEMM
    128 x 256 from r = 160; moe_gemm up to r = 48."""
    active = max(1, min(num_experts, num_pairs))
    r = num_pairs / active
    if r <= (8 if mxfp4 else 48):
        return None
    if not mxfp4:
        down = MmaConfig(128, 256, 64, 8, 3) if r > 160 else MmaConfig(128, 128, 64, 8, 4)
        return MmaConfig(128, 128, 64, 8, 4), down
    if r <= 96:
        return (MmaConfig(64, 128 if inter % 128 == 0 else 64, 64, 4, 4),
                MmaConfig(64, 128 if hidden % 128 == 0 else 64, 64, 4, 4))
    if 160 < r <= 224:
        return MmaConfig(256, 64, 64, 8, 3), MmaConfig(256, 128, 64, 8, 3)
    return MmaConfig(128, 64, 64, 4, 4), MmaConfig(128, 128, 64, 8, 4)
