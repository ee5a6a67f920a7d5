"""Softmax top-k expert routing (gpt-oss, Mixtral-style routers)."""

from __future__ import annotations

import torch

from dayzero.ops.registry import reference_op


@reference_op("route_softmax_topk")
def route_softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids int64 [T, k], weights float32 [T, k]).

    The k experts with the largest logits are chosen (ties as torch.topk: sorted by logit, largest
    first). renormalize=True: the weights are the softmax over the k chosen logits, so they sum to 1
    (gpt-oss takes the top-k first and softmaxes over those k; Mixtral's softmax-then-renormalize is
    the same function). renormalize=False: the weights are the chosen entries of the softmax over
    all E logits. Computed in float32 whatever the logits' dtype.
    """
    if logits.dim() != 2:
        raise ValueError(f"route_softmax_topk: logits must be [tokens, experts], got {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"route_softmax_topk: top_k={top_k} must lie in [1, {logits.shape[1]}] (the number of experts)")
    logits = logits.float()
    top_logits, ids = torch.topk(logits, top_k, dim=-1)
    if renormalize:
        return ids, torch.softmax(top_logits, dim=-1)
    return ids, torch.softmax(logits, dim=-1).gather(-1, ids)
