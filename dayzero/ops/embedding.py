"""Token embedding lookup."""

from __future__ import annotations

import torch

from dayzero.ops.registry import reference_op


@reference_op("embedding")
def embedding(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight [vocab, hidden] rows for token_ids [...] -> [..., hidden]; ids outside the vocabulary raise
    on the CPU. On an accelerator the ids are not read back (that would synchronise every step): callers
    validate them on the host (the engine's request checks, the [B, T] model API's check_inputs)."""
    if token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embedding: token ids must be int32 or int64, got {token_ids.dtype}")
    vocab = weight.shape[0]
    if token_ids.device.type == "cpu" and token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab)][0].item()
        raise ValueError(f"embedding: token id {bad} is outside the vocabulary [0, {vocab})")
    return weight[token_ids]
