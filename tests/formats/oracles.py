"""Reference decoders built on ml_dtypes only, so the tests never check dayzero against itself."""

import ml_dtypes
import numpy as np
import torch


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8, 0..15) -> float64 through ml_dtypes.float4_e2m1fn."""
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def e8m0_values(scale_bytes: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float64 through ml_dtypes.float8_e8m0fnu (0xFF -> NaN)."""
    return scale_bytes.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> codes [..., 2n], the low nibble is the even element."""
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Canonical blocks uint8 [..., nb, 16], scales uint8 [..., nb] -> float64 [..., nb * 32]."""
    values = e2m1_values(unpack_codes(blocks)) * e8m0_values(scales)[..., None]
    return values.reshape(*scales.shape[:-1], -1)


def e4m3_bytes(x: np.ndarray) -> np.ndarray:
    """float64 -> float8_e4m3fn bit patterns (round to nearest even) through ml_dtypes."""
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_values(q: torch.Tensor) -> np.ndarray:
    """torch float8_e4m3fn -> float64 decoded by ml_dtypes."""
    return q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def same_bits(a: torch.Tensor, b: np.ndarray) -> bool:
    """Bitwise equality of a float32 tensor and a float64 array rounded to float32 (NaN == NaN, -0 != 0)."""
    a = a.float().numpy()
    with np.errstate(over="ignore"):  # values past the float32 range become +-Inf, as in torch
        b = b.astype(np.float32)
    nan = np.isnan(a)
    if not np.array_equal(nan, np.isnan(b)):
        return False
    return np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))
