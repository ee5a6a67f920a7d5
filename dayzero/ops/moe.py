"""Routed-expert computation: tokens x (top-k experts) -> weighted sum of expert MLP outputs.

Canonical in-memory layout of one layer's routed experts (whatever the checkpoint's layout; the
model's loader maps onto it):
    w13: gate and up projections stacked along N, gate rows first: [E, 2*I, H]
    w2:  down projection: [E, H, I]
    b13: optional bias [E, 2*I] (gate first, like w13); b2: optional bias [E, H]
Storage by format (`ExpertWeights.format`):
    "bf16":  w13 / w2 are float tensors (bf16 or float32)
    "fp8":   w13 / w2 float8_e4m3fn, with w13_scale / w2_scale block scales
             [E, ceil(N/128), ceil(K/128)] (float32 or float8_e8m0fnu), DeepSeek `weight_scale_inv`
    "mxfp4": w13 / w2 canonical MXFP4 blocks uint8 [E, N, K/32, 16], w13_scale / w2_scale E8M0
             bytes uint8 [E, N, K/32] (dayzero.formats.mxfp4)
Activation between the two projections (`Activation`): "swiglu" (silu(gate) * up, with an optional
`limit` clamp as DeepSeek-V4) or "swiglu_clamped" (gpt-oss: alpha, limit, (up + 1)).

Each format is its own op so that kernels register per format: moe_experts_bf16, moe_experts_fp8,
moe_experts_mxfp4. The references dequantize only the experts the step activates, one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dayzero.formats import mxfp4
from dayzero.formats.fp8 import dequantize_weight_blocks
from dayzero.ops.activation import swiglu, swiglu_clamped
from dayzero.ops.registry import reference_op

EXPERT_FORMATS = ("bf16", "fp8", "mxfp4")


@dataclass(frozen=True)
class Activation:
    kind: str = "swiglu"  # "swiglu" | "swiglu_clamped"
    limit: float | None = None
    alpha: float | None = None  # swiglu_clamped only

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return swiglu(gate, up, limit=self.limit)
        if self.kind == "swiglu_clamped":
            return swiglu_clamped(gate, up, alpha=self.alpha, limit=self.limit)
        raise ValueError(f"unknown expert activation {self.kind!r}; supported: swiglu, swiglu_clamped")


@dataclass
class ExpertWeights:
    """One layer's routed experts in the canonical layout described in the module docstring.

    workspace: the engine's FP8 expert workspace (dayzero.kernels.moe.Fp8Workspace) that MXFP4 kernels
    may convert these experts into (path B); None where the engine has none. The reference ignores it."""

    format: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    workspace: object | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def dequantize(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of one expert in `dtype`."""
        if self.format == "bf16":
            return self.w13[expert].to(dtype), self.w2[expert].to(dtype)
        if self.format == "fp8":
            return (dequantize_weight_blocks(self.w13[expert], self.w13_scale[expert], dtype=dtype),
                    dequantize_weight_blocks(self.w2[expert], self.w2_scale[expert], dtype=dtype))
        if self.format == "mxfp4":
            return (mxfp4.dequantize(self.w13[expert], self.w13_scale[expert], dtype=dtype),
                    mxfp4.dequantize(self.w2[expert], self.w2_scale[expert], dtype=dtype))
        raise ValueError(f"unknown expert format {self.format!r}; supported: {', '.join(EXPERT_FORMATS)}")


def _check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertWeights) -> None:
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [tokens, hidden], got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [tokens={x.shape[0]}, top_k]"
        )
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= experts.num_experts):
        raise ValueError(f"moe_experts: expert ids must lie in [0, {experts.num_experts})")


def _experts_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertWeights, activation: Activation
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), computed in x.dtype per active expert."""
    _check_routing(x, topk_ids, topk_weights, experts)
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        w13, w2 = experts.dequantize(e, x.dtype)
        h = x[token] @ w13.T
        if experts.b13 is not None:
            h = h + experts.b13[e].to(x.dtype)
        gate, up = h.chunk(2, dim=-1)
        y = activation(gate, up) @ w2.T
        if experts.b2 is not None:
            y = y + experts.b2[e].to(x.dtype)
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(x.dtype))
    return out


@reference_op("moe_experts_bf16")
def moe_experts_bf16(x, topk_ids, topk_weights, experts: ExpertWeights, activation: Activation) -> torch.Tensor:
    """Routed experts stored in bf16/float (format "bf16"); x [T, H], topk_ids/weights [T, k] -> [T, H]."""
    return _experts_reference(x, topk_ids, topk_weights, experts, activation)


@reference_op("moe_experts_fp8")
def moe_experts_fp8(x, topk_ids, topk_weights, experts: ExpertWeights, activation: Activation) -> torch.Tensor:
    """Routed experts in FP8 E4M3 with 128x128 block scales; the reference dequantizes active experts."""
    return _experts_reference(x, topk_ids, topk_weights, experts, activation)


@reference_op("moe_experts_mxfp4")
def moe_experts_mxfp4(x, topk_ids, topk_weights, experts: ExpertWeights, activation: Activation) -> torch.Tensor:
    """Routed experts in canonical MXFP4; the reference dequantizes active experts exactly to x.dtype."""
    return _experts_reference(x, topk_ids, topk_weights, experts, activation)


MOE_EXPERT_OPS = {"bf16": moe_experts_bf16, "fp8": moe_experts_fp8, "mxfp4": moe_experts_mxfp4}
