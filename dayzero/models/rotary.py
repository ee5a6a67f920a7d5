"""Rotary position tables: inverse frequencies for plain RoPE and YaRN, and cos/sin per position.

YaRN (Peng et al. 2023, arXiv 2309.00071) blends, per frequency, the original inverse frequency
(extrapolation, high-frequency dims) and the one divided by `factor` (interpolation, low-frequency
dims), with a linear ramp between the dims that complete `beta_fast` and `beta_slow` rotations over
the original context; the attention logits are tempered by the "mscale" 0.1 ln(factor) + 1, which
implementations fold into cos/sin (`attention_scaling`). DeepSeek configs give `mscale` and
`mscale_all_dim`: the cos/sin factor is then mscale(factor, mscale) / mscale(factor, mscale_all_dim)
and model code may scale the softmax separately. All tables are float32, as upstream computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dayzero import ops


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class Rope:
    inv_freq: torch.Tensor  # float32 [dim / 2]
    attention_scaling: float = 1.0
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)  # device -> inv_freq there

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (any shape, integer) -> cos, sin float32 [..., dim / 2], times attention_scaling."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:  # copied once per device: a copy from host memory would synchronise every step
            inv_freq = self._on_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def rope_from_config(params: dict | None, dim: int, theta: float, max_position_embeddings: int | None = None) -> Rope:
    """Build the table from a config's rope parameters (`rope_scaling` / `rope_parameters` dict).

    Supported `rope_type` (or `type`): default / None, yarn. Anything else raises ValueError
    naming the value."""
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = float(params.get("rope_theta", theta))
    wavelength_base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    base_inv = 1.0 / wavelength_base
    if kind == "default":
        return Rope(base_inv)
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported; supported: default, yarn")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("yarn rope scaling needs factor (or max_position_embeddings)")
        factor = max_position_embeddings / original
    factor = float(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim index whose wavelength fits `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = 1.0 / (factor * wavelength_base) * (1 - extrapolate) + base_inv * extrapolate

    scaling = params.get("attention_factor")
    if scaling is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        scaling = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all else yarn_mscale(factor)
    return Rope(inv_freq, float(scaling))


def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] with its first 2 * cos.shape[-1] dims rotated in half-split pairs (ops.rope), the rest as
    is: partial rotary (GLM-4.x, Qwen3.5) when the table covers fewer than D / 2 frequencies."""
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        return ops.rope(x, cos, sin, interleaved=False)
    return torch.cat((ops.rope(x[..., :rot], cos, sin, interleaved=False), x[..., rot:]), dim=-1)
