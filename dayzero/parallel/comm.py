"""The collectives of a tensor-parallel step, over the tensor-parallel group of `state.current()`; each
is a no-op (returns its input) in a job of one process.

    all_reduce(x)         the sum over ranks, in place (row-parallel projections, the vocabulary-parallel
                          embedding)
    all_gather(x, dim)    the ranks' pieces concatenated along dim, in rank order (column-parallel outputs
                          the next op needs whole: the lm_head's logits)
    broadcast_objects(x)  rank 0's picklable host objects to every rank (a step's schedule)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dayzero.parallel.state import current


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    p = current()
    if p.tp_size == 1:
        return x
    dist.all_reduce(x, group=p.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    p = current()
    if p.tp_size == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(p.tp_size)]
    dist.all_gather(pieces, x, group=p.group)
    return torch.cat(pieces, dim=dim)


def broadcast_objects(objects: list[Any] | None) -> list[Any]:
    """Rank 0 passes its list; every other rank passes None and gets rank 0's (same length on every
    rank: the length goes first)."""
    p = current()
    if p.tp_size == 1:
        return objects
    box = [objects]
    dist.broadcast_object_list(box, src=0, group=p.group)
    return box[0]
