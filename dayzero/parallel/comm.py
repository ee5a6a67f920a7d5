"""The collectives of a parallel step, over the groups of `state.current()`; each is a no-op (returns its
input) where the process has no such group (one process, or a group of one inside a larger job).

    all_reduce(x)         the sum over ranks, in place (row-parallel projections, the vocabulary-parallel
                          embedding)
    all_gather(x, dim)    the ranks' pieces concatenated along dim, in rank order (column-parallel outputs
                          the next op needs whole: the lm_head's logits)
    all_reduce_experts(x) the sum over the ranks holding the other shares of the routed experts (expert
                          parallel: every rank has every token, each computes its experts' part)
    broadcast_objects(x)  rank 0's picklable host objects to every rank of the job (a step's schedule)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dayzero.parallel.state import current


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    p = current()
    return _sum(x, p.tp_group)


def all_reduce_experts(x: torch.Tensor) -> torch.Tensor:
    return _sum(x, current().ep_group)


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    p = current()
    if p.tp_group is None:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(p.tp_size)]
    dist.all_gather(pieces, x, group=p.tp_group)
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def broadcast_objects(objects: list[Any] | None) -> list[Any]:
    """Rank 0 passes its list; every other rank passes None and gets rank 0's."""
    p = current()
    if p.world_size == 1:
        return objects
    box = [objects]
    dist.broadcast_object_list(box, src=0, group=p.host_group)
    return box[0]
