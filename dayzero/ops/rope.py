"""Rotary position embedding."""

from __future__ import annotations

import torch

from dayzero.ops.registry import reference_op


@reference_op("rope")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, H, D] (or [T, D]) by per-position angles; cos, sin: [T, D/2], float32.

    Pair layout: `interleaved=True` rotates (x[2i], x[2i+1]) (DeepSeek MLA's original layout);
    `interleaved=False` rotates (x[i], x[i + D/2]) (the NeoX "half split" layout, also used by
    the DSA indexer). Pair i turns by the angle whose cos/sin are cos[:, i], sin[:, i].
    Computed in float32, returned in x.dtype.
    """
    d = x.shape[-1]
    if d % 2 or cos.shape[-1] * 2 != d or sin.shape != cos.shape:
        raise ValueError(
            f"rope: x last dim {d} must be even and twice cos/sin last dim "
            f"(cos {tuple(cos.shape)}, sin {tuple(sin.shape)})"
        )
    if cos.shape[0] != x.shape[0]:
        raise ValueError(f"rope: cos has {cos.shape[0]} positions, x has {x.shape[0]} tokens")
    extra = x.dim() - 2
    c = cos.float().reshape(cos.shape[0], *([1] * extra), cos.shape[-1])
    s = sin.float().reshape(sin.shape[0], *([1] * extra), sin.shape[-1])
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2 :]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return out.to(x.dtype)
