"""DeepSeek-V3 expert routing: sigmoid scores, aux-loss-free correction bias, group-limited top-k.

DeepSeek-V3 (arXiv 2412.19437, §2.1.2) and Kimi-K2 route each token with `topk_method: noaux_tc`:
    s = sigmoid(router logits)                        [T, E]
    b = s + correction_bias                           selection only (the bias never weights)
    the E experts form n_group contiguous groups of E / n_group; a group scores the sum of its two
    best b (the max of its b when there is no bias); the topk_group best groups stay eligible
    top_k experts = the largest b among eligible experts
    weights = s of those experts, / (their sum + 1e-20) when normalize, then * scaling_factor
"""

from __future__ import annotations

import torch

from dayzero.ops.registry import reference_op


@reference_op("route_sigmoid_grouped")
def route_sigmoid_grouped(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    normalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited sigmoid routing (DeepSeek-V3 `noaux_tc`).

    logits: router logits [T, E] (any float dtype; scored in float32).
    correction_bias: float [E] added to the scores for expert and group selection only, or None.
    Returns (topk_ids int64 [T, top_k], topk_weights float32 [T, top_k]); the order of the k
    experts within a row is unspecified."""
    if logits.dim() != 2:
        raise ValueError(f"route_sigmoid_grouped: logits must be [tokens, experts], got {tuple(logits.shape)}")
    tokens, experts = logits.shape
    if correction_bias is not None and correction_bias.shape != (experts,):
        raise ValueError(f"route_sigmoid_grouped: correction_bias must be [{experts}], got {tuple(correction_bias.shape)}")
    if n_group < 1 or experts % n_group:
        raise ValueError(f"route_sigmoid_grouped: {experts} experts do not split into n_group={n_group} equal groups")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"route_sigmoid_grouped: topk_group={topk_group} must lie in [1, n_group={n_group}]")
    per_group = experts // n_group
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(
            f"route_sigmoid_grouped: top_k={top_k} must lie in [1, {topk_group * per_group}] "
            f"(topk_group={topk_group} groups of {per_group} experts)"
        )
    scores = logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if topk_group < n_group:
        grouped = choice.view(tokens, n_group, per_group)
        if correction_bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            if per_group < 2:
                raise ValueError("route_sigmoid_grouped: scoring groups by their two best experts needs >= 2 experts per group")
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, weights * scaling_factor
