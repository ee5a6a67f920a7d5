"""Weight format conversions as ops, so that device kernels can register beside the reference."""

from __future__ import annotations

import torch

from dayzero.formats import mxfp4
from dayzero.formats.mxfp4_fp8 import Mxfp4AsFp8, mxfp4_to_fp8
from dayzero.ops.registry import reference_op


@reference_op("mxfp4_dequantize")
def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Canonical MXFP4 (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]) -> dtype [..., K], exact."""
    return mxfp4.dequantize(blocks, scales, dtype)


@reference_op("mxfp4_to_fp8")
def mxfp4_to_fp8_op(blocks: torch.Tensor, scales: torch.Tensor, group: int = 128) -> Mxfp4AsFp8:
    """Canonical MXFP4 -> FP8 E4M3 values [..., K] + power-of-two scales [..., ceil(K/group)]
    (see dayzero.formats.mxfp4_fp8 for the exactness window and out-of-window count)."""
    return mxfp4_to_fp8(blocks, scales, group)
