"""DeepSeek-V4 expert routing: sqrt(softplus) scores, chosen by top-k (with the aux-loss-free
correction bias) or by a fixed token-id -> experts table (hash-routed layers).

Either way the weights are the chosen experts' scores, normalised to sum to 1 and multiplied by
`scaling` (routed_scaling_factor). Scores and weights are float32; expert ids int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.registry import reference_op

SCORE_FUNCTIONS = ("sqrtsoftplus", "sigmoid", "softmax")


def scores_of(logits: torch.Tensor, function: str) -> torch.Tensor:
    """Router logits [T, E] -> float32 scores by `function` (sqrtsoftplus | sigmoid | softmax)."""
    x = logits.float()
    if function == "sqrtsoftplus":
        return F.softplus(x).sqrt()
    if function == "sigmoid":
        return torch.sigmoid(x)
    if function == "softmax":
        return torch.softmax(x, dim=-1)
    raise ValueError(f"unknown routing score function {function!r}; supported: {', '.join(SCORE_FUNCTIONS)}")


def _normalised(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    weights = scores.gather(1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20) * scaling


@reference_op("route_sqrtsoftplus")
def route_sqrtsoftplus(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing on sqrt(softplus(logits)).

    logits: [T, E] router logits. correction_bias: float [E] or None, added to the scores for the
    choice only. Returns (ids int64 [T, top_k], weights float32 [T, top_k]): the top_k experts by
    score + bias (ordered by that sum, descending) and their unbiased scores normalised to sum 1,
    times `scaling`."""
    if logits.dim() != 2:
        raise ValueError(f"route_sqrtsoftplus: logits must be [tokens, experts], got {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"route_sqrtsoftplus: top_k must lie in [1, {num_experts}], got {top_k}")
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"route_sqrtsoftplus: correction_bias must be [{num_experts}], got {tuple(correction_bias.shape)}")
    scores = scores_of(logits, "sqrtsoftplus")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    ids = choice.topk(top_k, dim=-1).indices
    return ids, _normalised(scores, ids, scaling)


@reference_op("route_hash")
def route_hash(
    logits: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor, scaling: float = 1.0,
    score_function: str = "sqrtsoftplus",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing: token t goes to the experts tid2eid[token_ids[t]], weighted by their scores.

    logits: [T, E] router logits; token_ids: int [T]; tid2eid: int [vocab, top_k] (each row
    distinct expert ids). Returns (ids int64 [T, top_k] in table order, weights float32 [T, top_k]):
    score_function(logits) at those experts, normalised to sum 1, times `scaling`."""
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(f"route_hash: logits must be [T, E] and token_ids [T]; got {tuple(logits.shape)} and {tuple(token_ids.shape)}")
    if tid2eid.dim() != 2 or tid2eid.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"route_hash: tid2eid must be an int table [vocab, top_k], got {tid2eid.dtype} {tuple(tid2eid.shape)}")
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= tid2eid.shape[0]):
        raise ValueError(f"route_hash: token ids must lie in [0, {tid2eid.shape[0]}) (rows of tid2eid)")
    ids = tid2eid[token_ids.long()].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= logits.shape[1]):
        raise ValueError(f"route_hash: tid2eid names experts outside [0, {logits.shape[1]})")
    return ids, _normalised(scores_of(logits, score_function), ids, scaling)
