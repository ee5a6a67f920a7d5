"""Kimi K3's two new elementwise mechanisms: Block Attention Residuals and the SiTU activation.

Block Attention Residuals (AttnRes, Moonshot arXiv 2603.15031; K3 `attn_res_block_size`):
instead of the running residual sum, a sublayer reads a per-token softmax mix of N candidate
vectors (the embedding, the completed block sums, the current partial block sum):

    k_i     = v_i / sqrt(mean_d(v_i^2) + eps)                 RMS-normalised candidate, no weight yet
    s_i     = sum_d k_i[d] * (norm_weight[d] * query_weight[d])
    alpha   = softmax_i(s_i)                                   float32, no temperature, no 1/sqrt(D)
    h       = sum_i alpha_i * v_i                              float32, cast back to the candidates' dtype

This is `_apply_attn_res` of the published `modeling_kimi_linear.py` (moonshotai/Kimi-K3), as
transcribed by SGLang, vLLM-Ascend, mlxcel and llama.cpp: the RMSNorm has its own weight
(`*_res_norm.weight` [D]) and the pseudo-query is `nn.Linear(D, 1, bias=False)`
(`*_res_proj.weight` [1, D]); both are applied in float32 as one fused vector norm_w * proj_w
(llama.cpp and mlxcel fold it at load). The weighted sum uses the raw candidates v_i, not k_i.

SiTU (K3 `hidden_act: situ`, `activation_situ_beta` 4, `activation_situ_linear_beta` 25):

    situ(g, u) = beta * tanh(g / beta) * sigmoid(g)  *  linear_beta * tanh(u / linear_beta)

computed in float32 and cast back; with `linear_beta` None the up branch is u itself. For |g| much
smaller than beta it is silu(g) * u (tanh(z) ~ z); the gate factor is bounded by beta and the up
factor by linear_beta. Sources (all agree): the PyTorch `SituAndMul` quoted in tenstorrent/tt-metal
#51350, sgl-kernel-npu #770, TransformerEngine #3402, transformers PR #48890 (pairs gate/up in the
MLP because the up branch is clamped too). docs/kimi_k3.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dayzero.ops.moe import Activation
from dayzero.ops.registry import reference_op


def _check_attention_residual(candidates: torch.Tensor, query_weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    if candidates.dim() < 2 or candidates.shape[0] < 1:
        raise ValueError(
            f"attention_residual: candidates must be [N >= 1, ..., D] (candidate first), got {tuple(candidates.shape)}"
        )
    if not candidates.dtype.is_floating_point:
        raise ValueError(f"attention_residual: candidates must be floating point, got {candidates.dtype}")
    d = candidates.shape[-1]
    if query_weight.dim() == 2 and query_weight.shape[0] == 1:  # nn.Linear(D, 1).weight as shipped
        query_weight = query_weight[0]
    if query_weight.shape != (d,):
        raise ValueError(
            f"attention_residual: query_weight must be [D={d}] or [1, D] (the `*_res_proj.weight`), got {tuple(query_weight.shape)}"
        )
    if norm_weight.shape != (d,):
        raise ValueError(
            f"attention_residual: norm_weight must be [D={d}] (the `*_res_norm.weight`), got {tuple(norm_weight.shape)}"
        )
    return query_weight


@reference_op("attention_residual")
def attention_residual(
    candidates: torch.Tensor, query_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Block Attention Residuals mix (module docstring) of one mixing point.

    candidates:   [N, ..., D] any float dtype; candidate i is candidates[i] (K3 order: embedding,
                  completed blocks oldest first, current partial block last; the order does not
                  change the result).
    query_weight: [D] or [1, D] (`*_res_proj.weight`), norm_weight: [D] (`*_res_norm.weight`).
    eps:          the RMSNorm epsilon (`rms_norm_eps`).
    Returns [..., D] in candidates.dtype. Scores, softmax and the weighted sum run in float32
    (float64 for float64 candidates). With N = 1 the result is candidates[0].
    """
    query_weight = _check_attention_residual(candidates, query_weight, norm_weight)
    compute = torch.float64 if candidates.dtype == torch.float64 else torch.float32
    v = candidates.to(compute)
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    score_weight = norm_weight.to(compute) * query_weight.to(compute)
    alpha = (k * score_weight).sum(-1).softmax(dim=0)  # [N, ...]
    return (alpha.unsqueeze(-1) * v).sum(0).to(candidates.dtype)


@reference_op("situ")
def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None = None) -> torch.Tensor:
    """SiTU gated activation (module docstring): beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta).

    gate, up: same shape [..., I], float. beta > 0; linear_beta > 0 or None (up unchanged).
    Computed in float32 (float64 for float64 inputs), returned in gate.dtype.
    """
    if gate.shape != up.shape:
        raise ValueError(f"situ: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if not (gate.dtype.is_floating_point and up.dtype.is_floating_point):
        raise ValueError(f"situ: gate and up must be floating point, got {gate.dtype} and {up.dtype}")
    if not beta > 0:
        raise ValueError(f"situ: beta (activation_situ_beta) must be > 0, got {beta}")
    if linear_beta is not None and not linear_beta > 0:
        raise ValueError(f"situ: linear_beta (activation_situ_linear_beta) must be > 0 or None, got {linear_beta}")
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(compute), up.to(compute)
    activated = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (activated * u).to(gate.dtype)


@dataclass(frozen=True)
class SituActivation(Activation):
    """SiTU as the activation between a routed expert's two projections (dayzero.ops.moe): the
    reference expert ops call `activation(gate, up)`; kernels dispatch on `kind == "situ"`."""

    kind: str = "situ"
    beta: float = 4.0
    linear_beta: float | None = 25.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ(gate, up, self.beta, self.linear_beta)
