"""Modules that hold weights in their shipped format and call ops; shared by the model files."""

from __future__ import annotations

import math

import torch
from torch import nn

from dayzero import ops
from dayzero.models.base import WeightTarget, copy_target, empty_param
from dayzero.parallel import comm
from dayzero.weights.values import SCALES


class Linear(nn.Module):
    """y = x W^T (+ b) with W stored as shipped.

    fmt "bf16": `weight` [out, in] in the model dtype.
    fmt "fp8":  `weight` float8_e4m3fn [out, in] and a block scale tensor [ceil(out/bo), ceil(in/bi)]
                named `scale_name` (HF DeepSeek: `weight_scale_inv`; DeepSeek-V4 original: `scale`),
                of dtype `scale_dtype` (float32, or float8_e8m0fnu for ue8m0 scales).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, fmt: str = "bf16",
                 dtype: torch.dtype = torch.float32, device=None, block: tuple[int, int] = (128, 128),
                 scale_name: str = "weight_scale_inv", scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.block = in_features, out_features, fmt, tuple(block)
        self.scale_name = scale_name
        if fmt == "bf16":
            self.weight = empty_param((out_features, in_features), dtype, device)
        elif fmt == "fp8":
            self.weight = empty_param((out_features, in_features), torch.float8_e4m3fn, device)
            grid = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
            self.register_parameter(scale_name, empty_param(grid, scale_dtype, device))
        else:
            raise ValueError(f"Linear: unsupported weight format {fmt!r}; supported: bf16, fp8")
        self.bias = empty_param((out_features,), dtype, device) if bias else None

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """Every parameter copied as stored; an FP8 weight's scales are checked (finite, >= 0)."""
        targets = {prefix + n: copy_target(p, prefix + n) for n, p in self.named_parameters(recurse=False)}
        if self.fmt == "fp8":
            name = prefix + self.scale_name
            targets[name] = copy_target(getattr(self, self.scale_name), name, check=SCALES)
        return targets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "fp8":
            return ops.linear_fp8_block(x, self.weight, getattr(self, self.scale_name), self.bias, self.block)
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = empty_param((dim,), dtype, device)

    weight_in_float32 = False  # gpt-oss scales in float32 and casts after (dayzero.ops.norm.rms_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, weight_in_float32=self.weight_in_float32)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a residual add and this norm in one op."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, weight_in_float32=self.weight_in_float32)


def pre_norm_residuals(h: torch.Tensor, blocks) -> torch.Tensor:
    """The residual stream through pre-norm blocks, blocks = [(norm, fn), ...]: h = h + fn(norm(h)) for
    each in order, every add fused with the norm after it (RMSNorm.add: one op, not two)."""
    x = blocks[0][0](h)
    for i, (_, fn) in enumerate(blocks):
        y = fn(x)
        if i + 1 == len(blocks):
            return h + y
        x, h = blocks[i + 1][0].add(y, h)
    return h


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with `weight` and `bias` [dim] (ops.layer_norm: float32 inside)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = empty_param((dim,), dtype, device)
        self.bias = empty_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.weight = empty_param((vocab, dim), dtype, device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(token_ids, self.weight)


class BiasedRouter(nn.Module):
    """Router of sigmoid-scored MoE layers (DeepSeek-V3, Kimi Linear): `gate.weight` [E, hidden] and the
    aux-loss-free selection bias `gate.e_score_correction_bias` [E], both float32."""

    def __init__(self, num_experts: int, hidden: int, device=None):
        super().__init__()
        self.weight = empty_param((num_experts, hidden), torch.float32, device)
        self.e_score_correction_bias = empty_param((num_experts,), torch.float32, device)


def decode_and_prompt_segments(runs) -> list[tuple[int, int, bool]]:
    """(first, end, decodes) of consecutive runs of a step's sequences (SeqBatch.runs): decodes (one token
    each) or prompt chunks of any lengths together, so that a linear-attention layer (KDA, Gated DeltaNet)
    runs a step's decodes as one [B, 1] recurrent call and its prompts as one packed varlen chunk call."""
    out: list[tuple[int, int, bool]] = []
    for first, end, t in runs:
        if out and out[-1][2] == (t == 1):
            out[-1] = (out[-1][0], end, t == 1)
        else:
            out.append((first, end, t == 1))
    return out


def lm_logits(x: torch.Tensor, cache, norm: nn.Module, head: torch.Tensor) -> torch.Tensor:
    """A packed step's logits, float32 [R, vocab]: the rows the step returns (cache.logits_indices, every
    row when None), the final norm, the LM head (a tensor-parallel rank's vocabulary gathered)."""
    if cache.logits_indices is not None:
        x = x[cache.logits_indices]
    return comm.all_gather(ops.linear(norm(x), head), dim=-1).float()
