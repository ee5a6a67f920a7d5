"""Path B (the "fp8" kernel of moe_experts_mxfp4): routed experts converted online from MXFP4 to FP8 E4M3
into the cross-layer workspace (_workspace.py), then an FP8 grouped GEMM on the tensor cores with path
A's fused epilogue. The same GEMM is the "fp8" kernel of moe_experts_fp8 (DeepSeek-V3 FP8 experts).

Layouts:
    converted expert (one workspace slot), as dayzero.formats.mxfp4_fp8 defines it (bytes equal):
        w13 float8_e4m3fn [2I, H], w13_scale float32 [2I, ceil(H/128)]   one power of two per row per
        w2  float8_e4m3fn [H, I],  w2_scale  float32 [H, ceil(I/128)]    128 of K (W_SCALE_ROWS = 1)
    moe_experts_fp8 weights: w13 float8_e4m3fn [E, 2I, H], scale float32 [E, ceil(2I/128), ceil(H/128)]
        (DeepSeek weight_scale_inv, one per 128 x 128 block: W_SCALE_ROWS = 128); slot = expert.
    activations, two FP8 terms per value, one float32 scale per (row, 128 of K):
        a float8_e4m3fn [rows, 2, K], a_scale float32 [rows, ceil(K/128)]
        x ~= (a[:, 0] + a[:, 1]) * a_scale[:, k // 128]
        term 0 = x / scale rounded to E4M3 (scale = amax / 448, as dayzero.formats.fp8 "float32");
        term 1 = (x - term 0 * scale) / scale rounded: what term 0 left. E4M3 is a floating format, so
        the remainder keeps 3 significant bits at the same scale until it falls below 2^-6 (only for
        elements 2^-10 of the group's largest); a separate scale for it measured no better.
Why two terms: E4M3 keeps 3 mantissa bits, so one term costs about 2.5% relative error per GEMM
(2.6e-2 measured in float32 for a 2880-deep product on random data); two terms give 6e-4, below a
bf16 rounding of the activations (1.7e-3), as issue 7's 0.5% end-to-end target needs. They cost two
FP8 MMAs per weight tile (the tensor-core time of one bf16 MMA) and read the weights at 1 byte per
parameter; the two products accumulate in one chain (acc = W a0, then W a1 + acc).

The GEMM computes the transposed product like _gemm.py (weights are the left MMA operand,
acc[BLOCK_N, BLOCK_M]), with BLOCK_K = 128, the scale group: each K step's FP8 product is taken in
float32 and multiplied by weight scale x activation scale before it joins the accumulator. The
gate/up GEMM (BLOCK_N = 128) quantizes its activated output h into the down GEMM's two FP8 terms + scale
layout in its epilogue, one scale per (row, output tile).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dayzero.formats.mxfp4 import decode_e2m1_pairs, exp2_float32
from dayzero.kernels.moe._common import interpreting, kernel_activation
from dayzero.kernels.moe._dispatch import combine, dispatch
from dayzero.kernels.moe.choose import FP8_GROUP as GROUP
from dayzero.kernels.moe.configs import GemmConfig

TERMS = 2  # FP8 terms per activation value (module docstring)
FP8_MAX = 448.0


# -- MXFP4 -> FP8 conversion ----------------------------------------------------------------------

SHIFT_MIN = -20  # mxfp4_fp8 clamps r = e_b - e_ref to [-20, 6]: below -20 every E2M1 value rounds to zero


@functools.cache
def conversion_table(device: torch.device) -> torch.Tensor:
    """int16 [27 * 256]: entry (r - SHIFT_MIN) * 256 + b holds the two E4M3 bytes (even k low) of the packed
    E2M1 byte b times 2^r, for r in [-20, 6]: torch's float32 -> float8_e4m3fn conversion (round to
    nearest even) of exact float32 values, as mxfp4_fp8.mxfp4_to_fp8 computes them. 13.8 KB, L1-resident."""
    shifts = torch.arange(SHIFT_MIN, 7)
    pairs = decode_e2m1_pairs(torch.arange(256, dtype=torch.uint8)).view(1, 256, 2)
    values = pairs * exp2_float32(shifts).view(-1, 1, 1)  # exact in float32
    return values.to(torch.float8_e4m3fn).view(torch.uint8).contiguous().view(torch.int16).view(-1).to(device)


@triton.jit
def _convert_kernel(blocks_ptr, scales_ptr, experts_ptr, slots_ptr, table_ptr, out_ptr, out_scale_ptr, oow_ptr,
                    N, NB: tl.constexpr, G: tl.constexpr,
                    stride_be, stride_bn, stride_se, stride_sn, stride_oe, stride_on, stride_ose, stride_osn,
                    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """Rows n of expert experts[p] -> slot slots[p]: GROUPS scale groups (4 MXFP4 blocks each) per program.
    blocks uint8 [E, N, NB, 16], scales uint8 [E, N, NB]; out int16 (two E4M3 bytes) [slots, N, 16 NB],
    out_scale float32 [slots, N, G]; oow int32 [1] += blocks out of the E4M3 window. One table lookup
    per packed byte (conversion_table)."""
    p = tl.program_id(0)
    expert = tl.load(experts_ptr + p).to(tl.int64)
    slot = tl.load(slots_ptr + p).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    g = tl.program_id(2) * GROUPS + tl.arange(0, GROUPS)
    blk = g[:, None] * 4 + tl.arange(0, 4)[None, :]  # [GROUPS, 4]
    mask = n_mask[:, None, None] & (blk < NB)[None, :, :]
    sc = tl.load(scales_ptr + expert * stride_se + offs_n[:, None, None] * stride_sn + blk[None, :, :],
                 mask=mask, other=255).to(tl.int32)
    nan_block = sc == 255  # padding past NB loads as NaN: no part in the group max, not counted
    block_exp = sc - 127
    group_exp = tl.max(tl.where(nan_block, -(1 << 20), block_exp), axis=2)  # [BLOCK_N, GROUPS]
    shift = block_exp - (group_exp[:, :, None] - 6)  # <= 6
    lossy = tl.sum(tl.sum(tl.sum(((shift < -8) & ~nan_block).to(tl.int32), axis=2), axis=1), axis=0)
    tl.atomic_add(oow_ptr, lossy, mask=lossy > 0)  # rare: no contention on the counter

    row = (tl.minimum(tl.maximum(shift, -20), 6) + 20) * 256  # table row of the shift (NaN blocks: any row)
    byte_offs = blk[None, :, :, None] * 16 + tl.arange(0, 16)[None, None, None, :]  # [1, GROUPS, 4, 16]
    full = mask[:, :, :, None] & (byte_offs >= 0)
    packed = tl.load(blocks_ptr + expert * stride_be + offs_n[:, None, None, None] * stride_bn + byte_offs,
                     mask=full, other=0).to(tl.int32)
    pair = tl.load(table_ptr + row[:, :, :, None] + packed, mask=full, other=0)
    pair = tl.where(nan_block[:, :, :, None], 0x7F7F, pair)  # NaN block: E4M3 NaN, like the reference
    tl.store(out_ptr + slot * stride_oe + offs_n[:, None, None, None] * stride_on + byte_offs, pair.to(tl.int16),
             mask=full)

    e_ref = tl.maximum(group_exp - 6, -149)
    bits = tl.where(e_ref >= -126, (e_ref + 127) << 23, 1 << tl.minimum(tl.maximum(e_ref + 149, 0), 22))
    bits = tl.where(group_exp == -(1 << 20), 0x7FC00000, bits)  # every block NaN -> NaN scale
    tl.store(out_scale_ptr + slot * stride_ose + offs_n[:, None] * stride_osn + g[None, :],
             bits.to(tl.float32, bitcast=True), mask=n_mask[:, None] & (g < G)[None, :])


def convert_mxfp4_to_fp8(blocks, scales, experts: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                         out_scale: torch.Tensor, out_of_window: torch.Tensor) -> None:
    """Convert experts[i] of one projection (blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32])
    into out[slots[i]] (float8_e4m3fn [S, N, K]) and out_scale[slots[i]] (float32 [S, N, ceil(K/128)]),
    bytes equal to mxfp4_fp8.mxfp4_to_fp8; out_of_window (int32 [1]) counts the lossy blocks.
    experts / slots: int32 [n] on the device of the weights."""
    E, N, NB, _ = blocks.shape
    S, G = out.shape[0], out_scale.shape[2]
    want = {"out": (out, (S, N, NB * 32), torch.float8_e4m3fn), "out_scale": (out_scale, (S, N, G), torch.float32),
            "scales": (scales, (E, N, NB), torch.uint8), "out_of_window": (out_of_window, (1,), torch.int32)}
    for name, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != blocks.device or not t.is_contiguous():
            raise ValueError(f"convert_mxfp4_to_fp8: {name} must be contiguous {dtype} {shape} on {blocks.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if G != triton.cdiv(NB, 4) or experts.shape != slots.shape or experts.dtype != torch.int32:
        raise ValueError(f"convert_mxfp4_to_fp8: out_scale needs ceil(K/128) = {triton.cdiv(NB, 4)} groups and "
                         f"experts/slots int32 of one shape; got {G}, {experts.dtype} {tuple(experts.shape)}, "
                         f"{slots.dtype} {tuple(slots.shape)}")
    n = experts.numel()
    if n == 0:
        return
    block_n, groups = (128, 8) if interpreting() else (32, 2)  # the interpreter pays per program
    grid = (n, triton.cdiv(N, block_n), triton.cdiv(G, groups))
    pairs = out.view(torch.int16)
    _convert_kernel[grid](blocks, scales, experts, slots, conversion_table(blocks.device), pairs, out_scale,
                          out_of_window, N, NB, G, blocks.stride(0), blocks.stride(1), scales.stride(0),
                          scales.stride(1), pairs.stride(0), pairs.stride(1), out_scale.stride(0),
                          out_scale.stride(1), BLOCK_N=block_n, GROUPS=groups, num_warps=4)


# -- activation quantization ----------------------------------------------------------------------

@triton.jit
def _round_e4m3(v):
    """float32 -> the nearest E4M3 value (ties to even), as float32, saturating at +-448: 3 mantissa bits
    by integer rounding of the float32 bits, steps of 2^-9 below 2^-6 (E4M3's subnormals)."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = ((tl.abs(v) * 512.0 + 12582912.0) - 12582912.0) / 512.0  # 1.5 * 2^23: round to an integer
    subnormal = (subnormal.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # sign
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _as_e4m3(r, INTERPRET: tl.constexpr):
    """E4M3 of a float32 already on the E4M3 grid (_round_e4m3): exact in any rounding mode."""
    q = r.to(tl.float8e4nv)
    if INTERPRET:  # the interpreter drops the sign of -0
        q = (q.to(tl.uint8, bitcast=True) | tl.where(r.to(tl.int32, bitcast=True) < 0, 0x80, 0).to(tl.uint8))
        q = q.to(tl.float8e4nv, bitcast=True)
    return q


@triton.jit
def _quantize_terms(v, AXIS: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 values, 128 of them along AXIS -> (term 0, term 1, scale)."""
    amax = tl.max(tl.abs(v), axis=AXIS)
    scale = tl.maximum(amax / 448.0, 1.1754943508222875e-38)  # 2^-126 for all-zero groups, like formats.fp8
    s = tl.expand_dims(scale, AXIS)
    r0 = _round_e4m3(v / s)
    q0 = _as_e4m3(r0, INTERPRET)
    q1 = _as_e4m3(_round_e4m3((v - r0 * s) / s), INTERPRET)
    return q0, q1, scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, T, K: tl.constexpr, stride_x, stride_q, stride_s,
                     BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    offs_k = g * 128 + tl.arange(0, 128)
    row_mask = rows < T
    mask = row_mask[:, None] & (offs_k < K)[None, :]
    v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    q0, q1, scale = _quantize_terms(v, 1, INTERPRET)
    q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_q + offs_k[None, :]
    tl.store(q_ptrs, q0, mask=mask)
    tl.store(q_ptrs + K, q1, mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + g, scale, mask=row_mask)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (any float) -> (float8_e4m3fn [T, 2, K], float32 scales [T, ceil(K/128)]); module docstring."""
    T, K = x.shape
    G = triton.cdiv(K, GROUP)
    q = torch.empty(T, TERMS, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(T, G, dtype=torch.float32, device=x.device)
    if T:
        block_t = 16
        _quantize_kernel[(triton.cdiv(T, block_t), G)](x, q, s, T, K, x.stride(0), q.stride(0), s.stride(0),
                                                       BLOCK_T=block_t, INTERPRET=interpreting(), num_warps=4)
    return q, s


def dequantize_activations(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The float32 value quantize_activations' terms stand for (test oracle)."""
    return q.float().sum(1) * s.repeat_interleave(GROUP, dim=1)[:, :q.shape[2]]


# -- FP8 grouped GEMM -----------------------------------------------------------------------------

@triton.jit
def _scaled_dot(w_base, w_scale_base, offs_n, n_mask, offs_k, k_mask, g, a0, a1, a_scale, stride_wn, stride_sn,
                W_SCALE_ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_M]: one 128-deep K group of W x (A0 + A1)^T with both scales applied."""
    w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                other=0.0)
    w_scale = tl.load(w_scale_base + (offs_n // W_SCALE_ROWS) * stride_sn + g, mask=n_mask, other=0.0)
    if INTERPRET:  # the interpreter's dot takes no FP8 operands
        w = w.to(tl.float32)
    p = tl.dot(w, a0)
    p = tl.dot(w, a1, p)
    return p * (w_scale[:, None] * a_scale[None, :])


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, slot_ptr, bias_ptr, out_ptr, out_scale_ptr, row_pair_ptr,
    block_expert_ptr, router_weight_ptr,
    N, S, E, up_offset, alpha, limit,
    stride_am, stride_asm, stride_ws, stride_wn, stride_ss, stride_sn, stride_be, stride_om, stride_osm,
    K: tl.constexpr, W_SCALE_ROWS: tl.constexpr, GATHER: tl.constexpr, TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTER_WEIGHT: tl.constexpr,
    QUANT_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One [BLOCK_M rows x BLOCK_N outputs] tile of one expert, whose weights sit in slot slot[expert].
    Rows as _gemm.py's kernel (GATHER: A row = token of the pair). QUANT_OUT stores the tile as two FP8
    terms + one scale per row (BLOCK_N must be 128), else bf16."""
    BLOCK_K: tl.constexpr = 128
    mb = tl.program_id(0)
    expert = tl.load(block_expert_ptr + mb)
    if expert >= E:
        return
    nb = tl.program_id(1)
    slot = tl.load(slot_ptr + expert).to(tl.int64)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair_ptr + rows)
    row_valid = pair < S
    if GATHER:
        a_rows = tl.where(row_valid, pair // TOP_K, 0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_up = offs_n + up_offset
    w_base = w_ptr + slot * stride_ws
    ws_base = w_scale_ptr + slot * stride_ss
    GATED: tl.constexpr = ACTIVATION != 0

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        a_mask = row_valid[:, None] & k_mask[None, :]
        a0 = tl.trans(tl.load(a_ptrs, mask=a_mask, other=0.0))
        a1 = tl.trans(tl.load(a_ptrs + K, mask=a_mask, other=0.0))
        if INTERPRET:
            a0 = a0.to(tl.float32)
            a1 = a1.to(tl.float32)
        a_scale = tl.load(a_scale_ptr + a_rows * stride_asm + g, mask=row_valid, other=0.0)
        acc += _scaled_dot(w_base, ws_base, offs_n, n_mask, offs_k, k_mask, g, a0, a1, a_scale, stride_wn, stride_sn,
                           W_SCALE_ROWS, INTERPRET)
        if GATED:
            acc_up += _scaled_dot(w_base, ws_base, offs_up, n_mask, offs_k, k_mask, g, a0, a1, a_scale, stride_wn,
                                  stride_sn, W_SCALE_ROWS, INTERPRET)

    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_base + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_up += tl.load(b_base + offs_up, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if ACTIVATION == 1:  # swiglu, optional clamp (DeepSeek-V4 swiglu_limit)
        gate = acc
        up = acc_up
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        acc = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 2:  # gpt-oss: gate * sigmoid(alpha * gate) * (up + 1), both clamped
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    if ROUTER_WEIGHT:
        acc = acc * tl.load(router_weight_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)[None, :]
    out_rows = rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if QUANT_OUT:
        q0, q1, scale = _quantize_terms(tl.where(n_mask[:, None], acc, 0.0), 0, INTERPRET)
        tl.store(out_ptr + out_rows, tl.trans(q0), mask=n_mask[None, :])
        tl.store(out_ptr + out_rows + N, tl.trans(q1), mask=n_mask[None, :])
        tl.store(out_scale_ptr + rows.to(tl.int64) * stride_osm + nb, scale)
    else:
        tl.store(out_ptr + out_rows, tl.trans(acc).to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


def fp8_grouped_gemm(a, a_scale, w, w_scale, slot_of_expert, bias, d, *, out_features: int, gather: bool,
                     activation: int = 0, alpha: float = 1.0, limit: float | None = None, router_weights=None,
                     quant_out: bool = False, w_scale_rows: int = 1, config: GemmConfig):
    """Launch the FP8 GEMM over the padded rows of dispatch `d`. a: float8_e4m3fn [T or max_rows, 2, K]
    with a_scale float32 [., ceil(K/128)]; w: float8_e4m3fn [slots, N, K] with w_scale float32
    [slots, N / w_scale_rows, ceil(K/128)]; slot_of_expert int32 [E]. Returns bf16 [max_rows, out_features],
    or with quant_out (FP8 [max_rows, 2, out_features], float32 [max_rows, ceil(out_features/128)])."""
    K = a.shape[2]
    if config.block_k != GROUP or (quant_out and config.block_n != GROUP):
        raise ValueError(f"fp8_grouped_gemm: BLOCK_K must be {GROUP} (and BLOCK_N {GROUP} with quant_out), got {config}")
    dev = a.device
    if quant_out:
        out = torch.empty(d.max_rows, TERMS, out_features, dtype=torch.float8_e4m3fn, device=dev)
        out_scale = torch.empty(d.max_rows, triton.cdiv(out_features, GROUP), dtype=torch.float32, device=dev)
    else:
        out = torch.empty(d.max_rows, out_features, dtype=torch.bfloat16, device=dev)
        out_scale = None
    if d.max_rows:
        dummy = d.pair_row  # stands in for absent optional pointers (never read)
        grid = (d.max_blocks, triton.cdiv(out_features, config.block_n))
        _fp8_gemm_kernel[grid](
            a, a_scale, w, w_scale, slot_of_expert, bias if bias is not None else dummy, out,
            out_scale if quant_out else dummy, d.row_pair, d.block_expert,
            router_weights if router_weights is not None else dummy,
            out_features, d.pair_row.shape[0], d.num_experts, out_features if activation else 0, float(alpha),
            float(limit) if limit is not None else 0.0,
            a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
            bias.stride(0) if bias is not None else 0, out.stride(0), out_scale.stride(0) if quant_out else 0,
            K=K, W_SCALE_ROWS=w_scale_rows, GATHER=gather, TOP_K=d.top_k, ACTIVATION=activation,
            HAS_LIMIT=limit is not None, HAS_BIAS=bias is not None, ROUTER_WEIGHT=router_weights is not None,
            QUANT_OUT=quant_out, BLOCK_M=config.block_m, BLOCK_N=config.block_n, INTERPRET=interpreting(),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return (out, out_scale) if quant_out else out


def moe_layer_fp8(x, topk_ids, topk_weights, w13, s13, w2, s2, slot_of_expert, b13, b2, activation, *,
                  num_experts: int, inter: int, configs: tuple[GemmConfig, GemmConfig],
                  w_scale_rows: int = 1) -> torch.Tensor:
    """dispatch -> quantize x -> gate/up FP8 GEMM (+ bias, activation, h quantized) -> down FP8 GEMM
    (+ bias, x router weight) -> combine. Arguments already checked; weights as fp8_grouped_gemm takes them."""
    T, H = x.shape
    c1, c2 = configs
    if c1.block_m != c2.block_m:
        raise ValueError(f"moe_layer_fp8: both GEMMs must use one BLOCK_M, got {c1.block_m} and {c2.block_m}")
    d = dispatch(topk_ids, num_experts, c1.block_m)
    a, a_scale = quantize_activations(x)
    act, alpha = kernel_activation(activation)
    h, h_scale = fp8_grouped_gemm(a, a_scale, w13, s13, slot_of_expert, b13, d, out_features=inter, gather=True,
                                  activation=act, alpha=alpha, limit=activation.limit, quant_out=True,
                                  w_scale_rows=w_scale_rows, config=c1)
    y = fp8_grouped_gemm(h, h_scale, w2, s2, slot_of_expert, b2, d, out_features=H, gather=False,
                         router_weights=topk_weights.contiguous().view(-1), w_scale_rows=w_scale_rows, config=c2)
    return combine(y, d, T, x.dtype)


@functools.cache
def identity_slots(num_experts: int, device: torch.device) -> torch.Tensor:
    """slot_of_expert of stored FP8 experts (moe_experts_fp8): each expert is its own slot."""
    return torch.arange(num_experts, dtype=torch.int32, device=device)
