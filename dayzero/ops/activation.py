"""Gated activations of the MLP and expert layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.registry import reference_op


@reference_op("swiglu")
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with `limit` (DeepSeek-V4 `swiglu_limit`), gate is first clamped above at
    limit and up to [-limit, limit]."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@reference_op("swiglu_clamped")
def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's SwiGLU: gate clamped above at `limit`, up clamped to [-limit, limit],
    out = gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)
