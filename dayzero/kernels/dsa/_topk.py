"""The top-k of each row of int64 order keys (dayzero/kernels/dsa/_index.py: distinct visible keys,
INT64_MIN for keys not visible) as key positions, shared by DSA's and DeepSeek-V4's indexers.

torch.topk selects a row in one thread block; it is exact here since the keys are distinct. A radix select
over many programs a row was measured beside it on the H200 and lost (BENCHMARKS.md: about 150 us of fixed
cost), so it is gone (git keeps it)."""

from __future__ import annotations

import torch

INT64_MIN = -2**63
LOW = 2**31 - 1  # an order key's low 32 bits are LOW - position (dsa/_index.py's _order_key)


def best_positions(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The columns (positions) of each row's min(k, W) largest order keys, best first, -1 for keys not
    visible. int64 [R, min(k, W)]."""
    top = torch.topk(keys, min(k, keys.shape[1]), dim=1, sorted=True).values  # distinct keys: exact order
    return (LOW - (top & 0xFFFFFFFF)).masked_fill_(top == INT64_MIN, -1)
