"""linear_fp8_block on CUDA: y = x W^T (+ b) with W float8_e4m3fn [N, K] under one scale per bn x bk
block, as the reference computes it (dayzero/ops/linear.py): every weight value is dequantized in
float32 (e4m3 value x its block's scale) and rounded once to x's dtype, then multiplied with x's values
as they are (activations are not quantized), products summed in float32.

Two paths, chosen here by the number of rows M (`choose`):
    fused     (M <= FUSED_ROWS: decode) one GEMM that reads each weight tile as FP8 (1 byte a parameter),
              dequantizes it in registers and multiplies on the tensor cores; the weight is the left
              operand (acc[BLOCK_N, BLOCK_M] = W_tile x^T, as the MoE kernels do) so that a few rows
              still fill the MMA's M; split over K when the output tiles alone leave SMs idle (float32
              partials [splits, M, N], summed after).
    dequant   (larger M: prefill) one pass writes the dequantized weight in x's dtype, then cuBLAS: at
              many rows the GEMM's time dwarfs the pass (1 byte read, 2 written a parameter).
DAYZERO_VARIANT=linear_fp8_block=fused|dequant pins one (bench/linear.py times both).

The e4m3 bytes are decoded by the hardware conversion when compiled and by their bit fields under the
interpreter (which has no FP8 type): sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals
m x 2^-9, 0x7F / 0xFF NaN; and rounded to bf16 by hand there (the interpreter's conversion truncates).
E8M0 scales: 2^(s - 127), 255 NaN."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dayzero import settings
from dayzero.kernels.devices import sm_count
from dayzero.kernels.moe._common import interpreting

FUSED_ROWS = 256  # rows up to which the fused GEMM runs (above: dequantize + cuBLAS)
PROGRAMS_PER_SM = 2  # the fused GEMM splits K until the grid has this many programs a SM


@triton.jit
def _e4m3(bits, INTERPRET: tl.constexpr):
    """float32 values of e4m3fn bytes (uint8)."""
    if INTERPRET:
        b = bits.to(tl.int32)
        e = (b >> 3) & 15
        m = b & 7
        normal = (((b & 128) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # m x 2^-9
        sub = tl.where((b & 128) != 0, -sub, sub)
        v = tl.where(e == 0, sub, normal)
        return tl.where((b & 127) == 127, float("nan"), v)
    else:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _rounded(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 v in DTYPE, rounded to nearest even (the interpreter's own bf16 conversion truncates)."""
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        up = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        v = tl.where(v != v, v, up)
    return v.to(DTYPE)


@triton.jit
def _scale(ptr, mask, E8M0: tl.constexpr):
    """float32 block scales: float32 values, or E8M0 bytes as 2^(s - 127) (255: NaN)."""
    if E8M0:
        s = tl.load(ptr, mask=mask, other=127).to(tl.int32)
        v = tl.where(s == 0, 5.877471754111438e-39, (s << 23).to(tl.float32, bitcast=True))  # 2^-127: subnormal
        return tl.where(s == 255, float("nan"), v)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _k_step(acc, kb, w_rows, x_cols, s_rows, n_ok, m_ok, K, E8M0: tl.constexpr, BLOCK_K: tl.constexpr,
            IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + W[:, kb-th BLOCK_K] dequantized x x[:, the same]^T."""
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    bits = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    scale = _scale(s_rows + kb, n_ok & (kb * BLOCK_K < K), E8M0)
    w = _rounded(_e4m3(bits, INTERPRET) * scale[:, None], x_cols.dtype.element_ty, INTERPRET)  # the reference's
    xt = tl.load(x_cols + offs_k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
    if IEEE:  # float32 activations (and the interpreter, which cannot multiply bf16): exact products
        return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(w, xt, acc)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, k_steps, stride_xm, stride_sn, stride_os, stride_om,
                 BN_SCALE: tl.constexpr, K_STEPS: tl.constexpr, E8M0: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """out[split, m, n] (the split's partial sum; the whole sum with its bias when there is one split) of
    k_steps blocks of BLOCK_K (= the scale block's K) from the split's first (K_STEPS: the same as a
    constant, for the interpreter, which loops to constant bounds only; 0 when compiled: one kernel for
    every split)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    s_rows = s_ptr + (offs_n // BN_SCALE) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if INTERPRET:
        for i in range(K_STEPS):
            acc = _k_step(acc, pid_s * K_STEPS + i, w_rows, x_cols, s_rows, n_ok, m_ok, K, E8M0, BLOCK_K, IEEE,
                          INTERPRET)
    else:
        for i in range(0, k_steps):
            acc = _k_step(acc, pid_s * k_steps + i, w_rows, x_cols, s_rows, n_ok, m_ok, K, E8M0, BLOCK_K, IEEE,
                          INTERPRET)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    dst = out_ptr + pid_s * stride_os + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(dst, _rounded(acc, out_ptr.dtype.element_ty, INTERPRET), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_sn, BN_SCALE: tl.constexpr, E8M0: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """out [N, K] in its dtype = e4m3 value x block scale, rounded once."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.program_id(1)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    mask = n_ok[:, None] & (offs_k < K)[None, :]
    at = offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    scale = _scale(s_ptr + (offs_n // BN_SCALE) * stride_sn + kb, n_ok, E8M0)
    w = _e4m3(tl.load(w_ptr + at, mask=mask, other=0), INTERPRET) * scale[:, None]
    tl.store(out_ptr + at, _rounded(w, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def choose(m: int) -> str:
    """The path for M rows: "fused" or "dequant" (module docstring; a pinned variant wins)."""
    pinned = settings.get().variant("linear_fp8_block")
    if pinned in ("fused", "dequant"):
        return pinned
    return "fused" if m <= FUSED_ROWS else "dequant"


def _scales(scale_inv: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if scale_inv.dtype == torch.float8_e8m0fnu:
        return scale_inv.view(torch.uint8), True
    return scale_inv, False


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype`, as dequantize_weight_blocks computes it, in one pass."""
    n, k = weight.shape
    bn, bk = block
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    scales, e8m0 = _scales(scale_inv)
    block_n = 32
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, bk))](
        weight.view(torch.uint8), scales, out, n, k, scales.stride(0), BN_SCALE=bn, E8M0=e8m0, BLOCK_N=block_n,
        BLOCK_K=bk, INTERPRET=interpreting(), num_warps=4)
    return out


def _fused(x2: torch.Tensor, weight, scale_inv, bias, block, sms: int | None = None) -> torch.Tensor:
    """The fused GEMM; sms: the SMs to fill (default the device's; none on CPU: one split)."""
    m, k = x2.shape
    n = weight.shape[0]
    bn, bk = block
    block_m = min(64, max(16, triton.next_power_of_2(m))) if m <= 64 else 128
    block_n = 64 if m <= 64 else 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_blocks = triton.cdiv(k, bk)
    if sms is None:
        sms = sm_count(x2.device) if x2.is_cuda else 0
    want = PROGRAMS_PER_SM * sms
    splits = min(k_blocks, triton.cdiv(want, tiles)) if tiles < want else 1
    steps = triton.cdiv(k_blocks, splits)
    splits = triton.cdiv(k_blocks, steps)
    scales, e8m0 = _scales(scale_inv)
    if splits == 1:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    else:
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x2.device)
    interpret = interpreting()
    _gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)](
        x2, weight.view(torch.uint8), scales, bias if bias is not None else x2, out, m, n, k, steps, x2.stride(0),
        scales.stride(0), out.stride(0) if splits > 1 else 0, n, BN_SCALE=bn, K_STEPS=steps if interpret else 0,
        E8M0=e8m0,
        HAS_BIAS=bias is not None and splits == 1, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=bk,
        IEEE=x2.dtype == torch.float32 or interpret, INTERPRET=interpret, num_warps=4 if m <= 64 else 8,
        num_stages=4 if m <= 64 else 3)
    if splits == 1:
        return out
    total = out.sum(0)
    if bias is not None:
        total += bias.float()
    return total.to(x2.dtype)


def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias=None,
                     block=(128, 128)) -> torch.Tensor:
    """As dayzero.ops.linear.linear_fp8_block (checked by `supports`)."""
    block = (int(block[0]), int(block[1]))
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, n))
    if choose(m) == "dequant":
        return F.linear(x2, dequantize(weight, scale_inv, block, x.dtype), bias).view(*lead, n)
    return _fused(x2, weight, scale_inv, bias, block).view(*lead, n)
