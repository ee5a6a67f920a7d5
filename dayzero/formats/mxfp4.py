"""MXFP4 (OCP Microscaling, FP4 E2M1 elements with a shared E8M0 scale per 32 values).

Number format only; nothing here knows about models. See docs/formats.md for sources.

Element, E2M1: 4-bit code `s e e m`. Codes 0x0-0x7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 0x8-0xF
are the same values negated (0x8 is -0). No Inf, no NaN.
Scale, E8M0: unsigned byte b, value 2^(b - 127) for b = 0..254; b = 0xFF is NaN. No zero, no Inf.
Value of element i of a block: e2m1[i] * 2^(b - 127).
Packing: two elements per byte along K, the EVEN element (k = 2j) in the LOW nibble.

Canonical layout (gpt-oss `*_blocks` / `*_scales` on disk), used by every function here:
    blocks: uint8 [..., K/32, 16]   16 bytes = 32 packed E2M1 values of one block
    scales: uint8 [..., K/32]       one E8M0 byte per block
Two other on-disk layouts hold the same bytes and convert to and from it without copying:
    DeepSeek-V4 FP4 experts:      weight int8 [..., K/2],  scale float8_e8m0fnu [..., K/32]
    compressed-tensors mxfp4-pack-quantized (Kimi K3):
                                  weight_packed uint8 [..., K/2], weight_scale uint8 [..., K/32]
"""

import torch

BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_EMAX = 2  # exponent of the largest E2M1 value, 6 = 1.5 * 2^2
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Round-to-nearest-even onto the E2M1 magnitudes: the code of |y| is the number of these
# thresholds it passes. A tie goes to the even code, so ties at 0.25, 1.25, 2.5 and 5 stay
# down (strict >) and ties at 0.75, 1.75 and 3.5 go up (>=). Everything above 5 saturates to 6.
_RNE_UP_STRICT = (0.25, 1.25, 2.5, 5.0)
_RNE_UP_TIE = (0.75, 1.75, 3.5)


def exp2_float32(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32, built from the bit pattern so it is exact. e: integer tensor in [-149, 127]."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def decode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> float32 2^(b - 127), exact; 0xFF -> NaN.

    Every finite E8M0 value is exact in float32 (b = 0 is the subnormal 2^-127)."""
    b = as_e8m0_bytes(scales, "scales").to(torch.int32)
    value = exp2_float32(b - E8M0_BIAS)
    return torch.where(b == E8M0_NAN, torch.nan, value)


def decode_e2m1_pairs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] of packed E2M1 pairs -> float32 [..., 2n], low nibble first."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype} with shape {tuple(packed.shape)}")
    pair_values = _pair_table(packed.device)[packed.long()]  # [..., n, 2]
    return pair_values.flatten(-2)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., K] to MXFP4 along the last dim -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    Scale (OCP MX v1.0 section 6.3): shared exponent = floor(log2(amax of the block)) - 2, clamped to
    the E8M0 range [-127, 127]; it is read from the float's own exponent (frexp), not from log2.
    Elements: x / 2^shared_exp rounded to nearest, ties to even, onto the E2M1 grid, saturating
    at +-6 (values in (5, 8) become 6). The sign is kept, so tiny negatives become -0 (code 0x8).
    All-zero block: scale byte 0x00 (2^-127, the smallest), codes 0x0 (0x8 for -0.0).
    NaN anywhere in a block: scale byte 0xFF and all codes 0x0; the block dequantizes to NaN.
    +-Inf: ValueError (MXFP4 has no Inf; saturating would hide a broken tensor).
    Computed in float32 (float64 for float64 input), so every step is exact but the rounding.
    """
    if not x.dtype.is_floating_point:
        raise ValueError(f"quantize: x must be a floating tensor, got {x.dtype} with shape {tuple(x.shape)}")
    if x.ndim == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"quantize: x has shape {tuple(x.shape)}; its last dim K must be a multiple of {BLOCK_SIZE} "
            f"(one E8M0 scale per {BLOCK_SIZE} values along K). Pad K first."
        )
    inf = torch.isinf(x)
    if inf.any():
        first = tuple(int(i) for i in inf.nonzero()[0])
        raise ValueError(
            f"quantize: x contains {int(inf.sum())} infinite value(s), first at index {first}; "
            "MXFP4 has no Inf. Clamp or replace them before quantizing."
        )
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(compute).unflatten(-1, (-1, BLOCK_SIZE))  # [..., nb, 32]
    nan_block = torch.isnan(x).any(-1)
    amax = torch.nan_to_num(x, nan=0.0).abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1), so floor(log2(amax)) = e - 1
    shared_exp = (e - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    shared_exp = torch.where(amax == 0, -E8M0_BIAS, shared_exp)
    y = x / exp2_float32(shared_exp).to(compute).unsqueeze(-1)  # exact: division by a power of two

    codes = _round_to_e2m1_codes(y)
    codes = torch.where(nan_block.unsqueeze(-1), 0, codes)
    scales = torch.where(nan_block, E8M0_NAN, shared_exp + E8M0_BIAS).to(torch.uint8)
    return pack_e2m1(codes), scales


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., nb, 32] (values 0..15) -> blocks uint8 [..., nb, 16], even code in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Canonical MXFP4 (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]) -> dtype [..., K].

    e2m1 * 2^(b-127) is computed exactly in float32 (float64 if dtype is float64) and then cast.
    Exact in float32 and bfloat16 for every scale byte b <= 252; with b = 253 or 254 the larger
    elements exceed the float32/bfloat16 range and become +-Inf (float64 is exact for all b).
    float16 is exact only for small exponents (it rounds or flushes below 2^-24 and overflows above 65504).
    A scale byte 0xFF turns the whole block into NaN.
    """
    check_blocks_scales(blocks, scales)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    values = decode_e2m1_pairs(blocks).to(compute)  # [..., nb, 32]
    values = values * decode_e8m0(scales).to(compute).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def from_deepseek_v4(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 FP4 expert (weight int8 [..., K/2], scale float8_e8m0fnu [..., K/32]) -> (blocks, scales).

    Same bytes, same nibble order (even element low), so this is a view. A scale already stored as
    uint8 is accepted too."""
    _check_packed(weight, scale, "weight", "scale", torch.int8)
    blocks = weight.view(torch.uint8).unflatten(-1, (-1, BLOCK_SIZE // 2))
    return blocks, as_e8m0_bytes(scale, "scale")


def to_deepseek_v4(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) -> DeepSeek-V4 layout (weight int8 [..., K/2], scale float8_e8m0fnu [..., K/32])."""
    check_blocks_scales(blocks, scales)
    return blocks.flatten(-2).view(torch.int8), scales.view(torch.float8_e8m0fnu)


def dequantize_deepseek_v4(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """DeepSeek-V4 FP4 expert weight int8 [..., K/2] with scale [..., K/32] -> dtype [..., K]."""
    return dequantize(*from_deepseek_v4(weight, scale), dtype=dtype)


def from_compressed_tensors(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors mxfp4-pack-quantized (weight_packed uint8 [..., K/2], weight_scale uint8
    [..., K/32]) -> (blocks, scales). Same bytes and nibble order, so this is a view."""
    _check_packed(weight_packed, weight_scale, "weight_packed", "weight_scale", torch.uint8)
    blocks = weight_packed.unflatten(-1, (-1, BLOCK_SIZE // 2))
    return blocks, as_e8m0_bytes(weight_scale, "weight_scale")


def to_compressed_tensors(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) -> compressed-tensors layout (weight_packed uint8 [..., K/2], weight_scale uint8 [..., K/32])."""
    check_blocks_scales(blocks, scales)
    return blocks.flatten(-2), scales


def dequantize_compressed_tensors(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """compressed-tensors mxfp4-pack-quantized weight_packed [..., K/2], weight_scale [..., K/32] -> dtype [..., K]."""
    return dequantize(*from_compressed_tensors(weight_packed, weight_scale), dtype=dtype)


def _round_to_e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Values already divided by the block scale -> E2M1 codes uint8 (RNE, saturating at 6)."""
    a = y.abs()
    magnitude = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t in _RNE_UP_STRICT:
        magnitude += a > t
    for t in _RNE_UP_TIE:
        magnitude += a >= t
    return magnitude | (torch.signbit(y).to(torch.uint8) << 3)


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """float32 [256, 2]: byte -> (value of low nibble, value of high nibble)."""
    if device not in _PAIR_TABLES:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        byte = torch.arange(256)
        _PAIR_TABLES[device] = torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1).to(device)
    return _PAIR_TABLES[device]


def as_e8m0_bytes(scales: torch.Tensor, name: str) -> torch.Tensor:
    if scales.dtype == torch.float8_e8m0fnu:
        return scales.view(torch.uint8)
    if scales.dtype != torch.uint8:
        raise ValueError(
            f"{name} must hold E8M0 bytes as uint8 or float8_e8m0fnu, got {scales.dtype} "
            f"with shape {tuple(scales.shape)}"
        )
    return scales


def check_blocks_scales(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or blocks.ndim < 2 or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(
            f"blocks must be uint8 [..., K/32, 16] (32 packed E2M1 values per block), got {blocks.dtype} "
            f"with shape {tuple(blocks.shape)}"
        )
    if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
        raise ValueError(
            f"scales must be uint8 with shape blocks.shape[:-1] = {tuple(blocks.shape[:-1])} "
            f"(one E8M0 byte per block), got {scales.dtype} with shape {tuple(scales.shape)}"
        )


def _check_packed(
    packed: torch.Tensor, scale: torch.Tensor, packed_name: str, scale_name: str, packed_dtype: torch.dtype
) -> None:
    if packed.dtype != packed_dtype or packed.ndim < 1 or packed.shape[-1] % (BLOCK_SIZE // 2) != 0:
        raise ValueError(
            f"{packed_name} must be {packed_dtype} [..., K/2] with K a multiple of {BLOCK_SIZE} "
            f"(two E2M1 values per byte), got {packed.dtype} with shape {tuple(packed.shape)}"
        )
    expected = (*packed.shape[:-1], packed.shape[-1] * 2 // BLOCK_SIZE)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{scale_name} must have shape {expected} (one E8M0 scale per {BLOCK_SIZE} values of "
            f"{packed_name} {tuple(packed.shape)}), got {scale.dtype} with shape {tuple(scale.shape)}"
        )
    as_e8m0_bytes(scale, scale_name)
