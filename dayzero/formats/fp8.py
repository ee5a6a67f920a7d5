"""FP8 E4M3 (torch.float8_e4m3fn, max 448) with DeepSeek-style block scales.

Number format only; nothing here knows about models. See docs/formats.md.

Weights: one scale per 128x128 block of the last two dims, as DeepSeek-V3 `weight_scale_inv`:
    w_fp8:     float8_e4m3fn [..., N, K]
    scale_inv: float32 (or float8_e8m0fnu) [..., ceil(N/128), ceil(K/128)]; edge blocks may be partial
    w = w_fp8 * scale_inv[n // 128, k // 128]
Activations: one scale per 1x128 group along K:
    x_fp8:  float8_e4m3fn [..., K]
    scales: float32 (or float8_e8m0fnu) [..., ceil(K/128)]
    x = x_fp8 * scales[..., k // 128]

Scale formats (amax = largest |value| of the block):
    "float32": scale = amax / 448 (float32)
    "ue8m0":   scale = 2^ceil(log2(amax / 448)), a power of two rounded UP so amax / scale <= 448;
               exponent clamped to the E8M0 range [-127, 127]. Returned as float32, or as
               torch.float8_e8m0fnu with scale_dtype=torch.float8_e8m0fnu (same value, exact).
An all-zero block gets the smallest scale of its format (2^-126 for float32, 2^-127 for ue8m0);
float32 scales are clamped up to 2^-126 for tiny blocks. Elements are x / scale, clamped to +-448
and cast with round-to-nearest-even. Inputs must be finite: NaN or Inf raises ValueError.
"""

import math

import torch

from dayzero.formats.mxfp4 import exp2_float32

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FORMATS = ("float32", "ue8m0")
_FLOAT32_MIN_NORMAL = 2.0**-126
_E8M0_EXP_RANGE = (-127, 127)


def quantize_weight_blocks(
    w: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    scale_format: str = "float32",
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (w_fp8 float8_e4m3fn [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)])."""
    _check_input(w, "w", min_ndim=2)
    return _quantize_blocks(w, tuple(block), scale_format, scale_dtype)


def dequantize_weight_blocks(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """w_fp8 [..., N, K] with scale_inv [..., ceil(N/bn), ceil(K/bk)] -> dtype [..., N, K], computed in float32."""
    _check_fp8(w_fp8, "w_fp8", min_ndim=2)
    return _dequantize_blocks(w_fp8, scale_inv, tuple(block), dtype, "scale_inv")


def quantize_activation_groups(
    x: torch.Tensor,
    group: int = 128,
    scale_format: str = "float32",
    scale_dtype: torch.dtype = torch.float32,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_fp8 float8_e4m3fn [..., K], scales [..., ceil(K/group)]), one scale per 1 x group.
    check_finite=False skips the NaN/Inf check (a host synchronisation): the engine's FP8 KV cache
    writes, whose inputs the model computed, inside a step that must not synchronise."""
    _check_input(x, "x", min_ndim=1, check_finite=check_finite)
    x_fp8, scales = _quantize_blocks(x.unsqueeze(-2), (1, group), scale_format, scale_dtype)
    return x_fp8.squeeze(-2), scales.squeeze(-2)


def dequantize_activation_groups(
    x_fp8: torch.Tensor,
    scales: torch.Tensor,
    group: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x_fp8 [..., K] with scales [..., ceil(K/group)] -> dtype [..., K], computed in float32."""
    _check_fp8(x_fp8, "x_fp8", min_ndim=1)
    if scales.ndim < 1:
        raise ValueError(f"scales must have shape [..., ceil(K/{group})], got a 0-d tensor")
    return _dequantize_blocks(x_fp8.unsqueeze(-2), scales.unsqueeze(-2), (1, group), dtype, "scales").squeeze(-2)


def ue8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    """ceil(log2(scale)) for positive float32 scale, exactly (from the float's exponent bits), as int32."""
    mantissa, e = torch.frexp(scale)  # scale = mantissa * 2^e, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, e - 1, e).to(torch.int32)


def _quantize_blocks(
    x: torch.Tensor, block: tuple[int, int], scale_format: str, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_block(block)
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
    if scale_dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"scale_dtype must be torch.float32 or torch.float8_e8m0fnu, got {scale_dtype}")
    if scale_dtype == torch.float8_e8m0fnu and scale_format != "ue8m0":
        raise ValueError("scale_dtype=torch.float8_e8m0fnu needs scale_format='ue8m0' (float32 scales are not powers of two)")

    x = x.float()
    tiles = _to_tiles(x, block)  # [..., gn, bn, gk, bk]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., gn, gk]
    if scale_format == "float32":
        scale = (amax / FP8_MAX).clamp(min=_FLOAT32_MIN_NORMAL)
    else:
        exponent = ue8m0_exponent(amax / FP8_MAX).clamp(*_E8M0_EXP_RANGE)
        scale = exp2_float32(torch.where(amax == 0, _E8M0_EXP_RANGE[0], exponent))
    q = (x / _expand(scale, block, x.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(scale_dtype)


def _dequantize_blocks(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, scale_name: str
) -> torch.Tensor:
    _check_block(block)
    n, k = q.shape[-2:]
    grid = (*q.shape[:-2], math.ceil(n / block[0]), math.ceil(k / block[1]))
    if tuple(scale.shape) != grid:
        got, want = tuple(scale.shape), grid
        if block[0] == 1:  # activation groups: show the shapes the caller passed
            got, want, shape = got[:-2] + got[-1:], want[:-2] + want[-1:], tuple(q.shape[:-2]) + (k,)
        else:
            shape = tuple(q.shape)
        raise ValueError(
            f"{scale_name} has shape {got} but the FP8 tensor {shape} with block {block} needs a scale "
            f"grid of shape {want} (ceil of each dim / block)"
        )
    if scale.dtype not in (torch.float32, torch.float8_e8m0fnu, torch.bfloat16, torch.float16):
        raise ValueError(f"{scale_name} must be float32, bfloat16, float16 or float8_e8m0fnu, got {scale.dtype}")
    return (q.float() * _expand(scale.float(), block, q.shape)).to(dtype)


def _to_tiles(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[..., N, K] -> zero-padded [..., ceil(N/bn), bn, ceil(K/bk), bk]."""
    bn, bk = block
    n, k = x.shape[-2:]
    x = torch.nn.functional.pad(x, (0, -k % bk, 0, -n % bn))
    return x.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Scale grid [..., gn, gk] -> one scale per element, [..., N, K] (edge blocks cropped)."""
    n, k = shape[-2:]
    return scale.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


def _check_block(block: tuple[int, int]) -> None:
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block}")


def _check_input(x: torch.Tensor, name: str, min_ndim: int, check_finite: bool = True) -> None:
    if not x.dtype.is_floating_point or x.dtype == FP8_DTYPE:
        raise ValueError(f"{name} must be a float32/bfloat16/float16 tensor, got {x.dtype} with shape {tuple(x.shape)}")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(x.shape)}")
    if check_finite and not torch.isfinite(x).all():
        raise ValueError(
            f"{name} {tuple(x.shape)} contains {int((~torch.isfinite(x)).sum())} NaN/Inf value(s); "
            "FP8 block quantization needs finite inputs"
        )


def _check_fp8(q: torch.Tensor, name: str, min_ndim: int) -> None:
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"{name} must be {FP8_DTYPE}, got {q.dtype} with shape {tuple(q.shape)}")
    if q.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(q.shape)}")
