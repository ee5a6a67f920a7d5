"""The collectives of a parallel step, over the groups of `state.current()`; each is a no-op (returns its
input) where the process has no such group (one process, or a group of one inside a larger job).

    all_reduce(x)         the sum over ranks, in place (row-parallel projections, the vocabulary-parallel
                          embedding)
    all_gather(x, dim)    the ranks' pieces concatenated along dim, in rank order (column-parallel outputs
                          the next op needs whole: the lm_head's logits)
    all_reduce_experts(x) the sum over the ranks holding the other shares of the routed experts (expert
                          parallel: every rank has every token, each computes its experts' part)
    all_to_all_experts(x, out_splits, in_splits)   rows of x sent to those ranks: in_splits[r] rows to the
                          r-th, out_splits[r] rows received from it (the all-to-all expert dispatch)
    all_gather_experts(x) those ranks' pieces of equal shape, concatenated along dim 0 in their order
    broadcast_objects(x)  rank 0's picklable host objects to every rank of the job (a step's schedule)
    broadcast(x)          rank 0's device tensor to every rank, in place, on the device (async scheduling: the
                          last step's sampled ids, which the host does not have yet)
    first_error(e)        every rank's outcome of a step that must succeed everywhere or nowhere (graph
                          capture): the first rank's error text, or None when every rank succeeded
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


def all_to_all_experts(x: torch.Tensor, out_splits: list[int] | None = None, in_splits: list[int] | None = None
                       ) -> torch.Tensor:
    group = current().ep_group
    if group is None:
        return x
    x = x.contiguous()
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_gather_experts(x: torch.Tensor) -> torch.Tensor:
    p = current()
    if p.ep_group is None:
        return x
    x = x.contiguous()
    out = x.new_empty((p.ep_size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=p.ep_group)
    return out


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


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x into every rank's x (same shape and dtype), over the job's device group (NCCL on CUDA:
    queued on the device, no host wait)."""
    if current().world_size > 1:
        dist.broadcast(x, src=0)
    return x


def first_error(error: str | None) -> str | None:
    """This rank's error (None: it succeeded) -> the lowest failing rank's, named, or None everywhere
    when every rank succeeded; every rank of the job calls it."""
    p = current()
    if p.world_size == 1:
        return error
    errors: list[str | None] = [None] * p.world_size
    dist.all_gather_object(errors, error, group=p.host_group)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)
