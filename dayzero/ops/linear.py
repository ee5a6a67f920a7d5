"""Dense projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.registry import reference_op


@reference_op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]), in x.dtype."""
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on K")
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
