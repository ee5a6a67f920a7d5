"""MXFP4 -> FP8 E4M3 with one power-of-two scale per [row, 128 values of K].

A block-scaled FP8 GEMM (DeepGEMM, cuBLAS 1x128 / 128x128) wants one scale per 128 along K, but
MXFP4 has one per 32. Each 32-block's E8M0 exponent e_b is folded into its FP8 elements relative
to a reference exponent e_ref shared by the group of 128 (4 blocks) of one row:

    fp8[k]      = e2m1[k] * 2^(e_b - e_ref)    rounded to E4M3 (nearest, ties to even)
    scales[g]   = 2^e_ref                       float32 [..., ceil(K/128)]
    value[k]    = fp8[k] * scales[k // 128]
    e_ref       = max(e_b over the group's blocks) - 6

The window. e2m1 * 2^r is exact in E4M3 exactly for r in [-8, 6]: r = 6 puts 6 at 384 <= 448
(r = 7 would give 768, past the E4M3 max 448), r = -8 puts 0.5 at 2^-9, the smallest E4M3
subnormal. With e_ref = e_max - 6 the largest block sits at r = 6, so every block with
e_b >= e_max - 14 converts exactly. A block with e_b < e_max - 14 (r <= -9) is out of the window:
its elements land in the E4M3 subnormal range (spacing 2^-9) and are rounded there, so each
element's error is at most half a subnormal step, 2^-10 * 2^e_ref = 2^(e_max - 16), and may flush
to (signed) zero. Relative to the group's largest representable magnitude 6 * 2^e_max that is
below 2^-18.

NaN: a block with scale byte 0xFF becomes E4M3 NaN and takes no part in e_ref; a group whose
blocks are all NaN gets a NaN scale. NaN blocks are not counted as out of window.
The count looks at scales only, so an all-zero block stored with a small scale (dayzero's
quantize uses 2^-127) is counted although it converts exactly: the count bounds the lossy blocks.
"""

from dataclasses import dataclass

import torch

from dayzero.formats.mxfp4 import (
    BLOCK_SIZE,
    E8M0_BIAS,
    E8M0_NAN,
    as_e8m0_bytes,
    check_blocks_scales,
    decode_e2m1_pairs,
    exp2_float32,
)

FP8_WINDOW = (-8, 6)  # r such that every e2m1 * 2^r is exact in float8_e4m3fn
GROUP_SIZE = 128
_NO_EXPONENT = -(1 << 20)  # stands in for NaN blocks and padding when taking the group max


@dataclass
class Mxfp4AsFp8:
    values: torch.Tensor  # float8_e4m3fn [..., K]
    scales: torch.Tensor  # float32 [..., ceil(K/group)], powers of two; value = values * scales per group
    out_of_window_blocks: int  # blocks more than 14 binades below their group's largest block (may be lossy)


def mxfp4_to_fp8(blocks: torch.Tensor, scales: torch.Tensor, group: int = GROUP_SIZE) -> Mxfp4AsFp8:
    """Canonical MXFP4 (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]) -> FP8 E4M3 values
    [..., K] with float32 power-of-two scales [..., ceil(K/group)]. See the module docstring for the
    window and the error bound of out-of-window blocks."""
    check_blocks_scales(blocks, scales)
    nan_block, shift, group_exp = _fold_exponents(scales, group)
    out_of_window = int(((shift < FP8_WINDOW[0]) & ~nan_block).sum())

    # Below r = -20 every E2M1 value rounds to zero in E4M3 anyway; the clamp keeps 2^r a float32.
    shift = shift.clamp(-20, FP8_WINDOW[1])
    values = decode_e2m1_pairs(blocks) * exp2_float32(shift).unsqueeze(-1)  # exact in float32
    values = torch.where(nan_block.unsqueeze(-1), torch.nan, values)
    e_ref = (group_exp - FP8_WINDOW[1]).clamp(min=-149)
    group_scale = torch.where(group_exp == _NO_EXPONENT, torch.nan, exp2_float32(e_ref))
    return Mxfp4AsFp8(values.flatten(-2).to(torch.float8_e4m3fn), group_scale, out_of_window)


def count_out_of_window_blocks(scales: torch.Tensor, group: int = GROUP_SIZE) -> int:
    """Blocks that mxfp4_to_fp8 would convert lossily, from the E8M0 scales alone.

    scales: uint8 or float8_e8m0fnu [..., K/32] in any of the MXFP4 layouts (cheap checkpoint audit)."""
    nan_block, shift, _ = _fold_exponents(as_e8m0_bytes(scales, "scales"), group)
    return int(((shift < FP8_WINDOW[0]) & ~nan_block).sum())


def _fold_exponents(
    scales: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E8M0 bytes [..., nb] -> (NaN mask [..., nb],
    shift r = e_b - e_ref [..., nb], group max exponent e_max [..., ng]; _NO_EXPONENT if all NaN)."""
    if group < BLOCK_SIZE or group % BLOCK_SIZE != 0:
        raise ValueError(f"group must be a positive multiple of {BLOCK_SIZE} (the MXFP4 block), got {group}")
    if scales.ndim < 1:
        raise ValueError("scales must have shape [..., K/32], got a 0-d tensor")
    per_group = group // BLOCK_SIZE
    b = scales.to(torch.int32)
    nan_block = b == E8M0_NAN
    block_exp = b - E8M0_BIAS
    masked = torch.where(nan_block, _NO_EXPONENT, block_exp)
    n_blocks = masked.shape[-1]
    pad = torch.full((*masked.shape[:-1], -n_blocks % per_group), _NO_EXPONENT, dtype=torch.int32, device=b.device)
    group_exp = torch.cat([masked, pad], dim=-1).unflatten(-1, (-1, per_group)).amax(-1)
    e_ref = group_exp.repeat_interleave(per_group, dim=-1)[..., :n_blocks] - FP8_WINDOW[1]
    return nan_block, block_exp - e_ref, group_exp
