"""Normalisation ops."""

from __future__ import annotations

import torch

from dayzero.ops.registry import reference_op


@reference_op("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, weight_in_float32: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim: normalise in float32, cast back to x.dtype, then scale by weight.

    The cast happens before the weight multiply, as in the DeepSeek/Llama family's reference
    modules, so bf16 results round the same way as upstream. weight_in_float32 (gpt-oss): scale by the
    weight in float32 and cast after, x.dtype out.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float32:
        return (normed * weight.float()).to(x.dtype)
    return weight * normed.to(x.dtype)


@reference_op("add_rms_norm")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 weight_in_float32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's residual add and the next norm in one op: s = residual + x (in x.dtype, as the
    unfused add rounds it), returns (rms_norm(s, weight, eps, weight_in_float32), s)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {residual.dtype} {tuple(residual.shape)} must match x "
                         f"{x.dtype} {tuple(x.shape)}")
    summed = residual + x
    return rms_norm(summed, weight, eps, weight_in_float32), summed


@reference_op("layer_norm")
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim, computed in float32 and returned in x.dtype."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"layer_norm: weight shape {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    out = torch.nn.functional.layer_norm(
        x.float(), x.shape[-1:], weight.float(), None if bias is None else bias.float(), eps
    )
    return out.to(x.dtype)
