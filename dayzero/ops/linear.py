"""Dense projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.formats import mxfp4
from dayzero.formats.fp8 import dequantize_weight_blocks
from dayzero.ops.registry import reference_op


@reference_op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]), in x.dtype."""
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on K")
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


@reference_op("linear_fp8_block")
def linear_fp8_block(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """x [..., K] @ W^T with W given as FP8 E4M3 weight [N, K] and block scales scale_inv
    [ceil(N/bn), ceil(K/bk)] (float32 or float8_e8m0fnu, DeepSeek `weight_scale_inv`).

    The reference dequantizes W to x.dtype and multiplies; activations are not quantized."""
    w = dequantize_weight_blocks(weight, scale_inv, block, dtype=x.dtype)
    return linear(x, w, bias)


@reference_op("linear_mxfp4")
def linear_mxfp4(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T with W in canonical MXFP4 (blocks uint8 [N, K/32, 16], scales uint8 [N, K/32]).

    The reference dequantizes W exactly to x.dtype and multiplies (BF16 activations, as OpenAI
    recommends for MXFP4 weights)."""
    return linear(x, mxfp4.dequantize(blocks, scales, dtype=x.dtype), bias)
