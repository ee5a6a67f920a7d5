"""This process's place in a parallel job.

A job of world = tp x ep processes, one per device, rank 0 the driver (it runs the scheduler and samples)
and the others workers. Rank r is tensor-parallel rank r % tp of expert-parallel group r // tp:

    tensor parallel (tp)   attention heads, the dense projections and the vocabulary split over the tp
                           ranks of a group (consecutive ranks: [e * tp, (e + 1) * tp))
    expert parallel (ep)   the routed experts split over the ep groups: rank r holds experts of its group
                           index r // tp; the ranks of one expert share (the same tp rank in every group:
                           r % tp, r % tp + tp, ...) sum their experts' outputs (an all-reduce)

Every group computes the same tokens (attention is replicated over the ep groups). `init_process` joins
the job (torch.distributed.init_process_group: NCCL on CUDA, gloo on the CPU), makes both kinds of groups
and a gloo group over the whole job for the host messages (a step's schedule: on NCCL jobs too, so that
sending it never waits on the device), and sets the process-wide `Parallel` that `current()` returns.
A process that never joins is the job of one (`SINGLE`, no groups), for which every collective is a
no-op; a job of one that did join (`init_process(1, 1, ...)`) runs its collectives for real, which is
how the communication's own cost is measured on one device.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    tp_group: Any = None  # this rank's tensor-parallel torch.distributed ProcessGroup (None: no collective)
    ep_group: Any = None  # the ranks that hold the other shares of the experts with it
    host_group: Any = None  # gloo, the whole job: rank 0's host messages (None: not in a job)
    backend: str = ""  # "nccl" | "gloo" | "" (not in a job)
    expert_dispatch: str = "all_reduce"  # how tokens reach the routed experts over ep (parallel/dispatch.py)

    def __post_init__(self):
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {self.tp_rank} is not in a group of size {self.tp_size}")
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"expert-parallel rank {self.ep_rank} is not in a group of size {self.ep_size}")
        check_expert_dispatch(self.expert_dispatch)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    @property
    def rank(self) -> int:
        return self.ep_rank * self.tp_size + self.tp_rank

    def split(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's tensor-parallel share of n items (heads, rows, vocabulary entries);
        `what` names them in the error when n does not divide."""
        return _share(n, self.tp_size, self.tp_rank, what, "tensor", "--tp")

    def split_experts(self, n: int) -> tuple[int, int]:
        """[start, stop) of the routed experts this rank holds."""
        return _share(n, self.ep_size, self.ep_rank, "n_routed_experts", "expert", "--ep")


EXPERT_DISPATCH = ("all_reduce", "all_to_all")


def check_expert_dispatch(mode: str) -> str:
    if mode not in EXPERT_DISPATCH:
        raise ValueError(f"expert_dispatch (--expert-dispatch) must be one of {', '.join(EXPERT_DISPATCH)}, got {mode!r}")
    return mode


def _share(n: int, size: int, rank: int, what: str, kind: str, flag: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"{what} = {n} does not split over {kind}-parallel size {size}; choose a {flag} that divides it")
    share = n // size
    return rank * share, (rank + 1) * share


SINGLE = Parallel()
_current = SINGLE


def current() -> Parallel:
    """This process's Parallel (SINGLE unless init_process ran)."""
    return _current


def init_process(tp_size: int, ep_size: int, rank: int, init_method: str, device: str | torch.device = "cpu",
                 timeout_s: float = 600.0) -> Parallel:
    """Join a job of tp_size x ep_size processes as `rank` (init_method: torch.distributed's, e.g.
    tcp://host:port); NCCL where the device is CUDA (device index = rank on one node), gloo on the CPU."""
    global _current
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else torch.device("cuda", rank))
    world = tp_size * ep_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank, timeout=timeout)
    # A group of the whole job is WORLD, a group of one (in a larger job) none; every rank makes every
    # other group, in the same order.
    tp_group = dist.group.WORLD if tp_size == world else None
    ep_group = dist.group.WORLD if ep_size == world else None
    if 1 < tp_size < world:
        for e in range(ep_size):
            g = dist.new_group(list(range(e * tp_size, (e + 1) * tp_size)))
            tp_group = g if rank // tp_size == e else tp_group
    if 1 < ep_size < world:
        for t in range(tp_size):
            g = dist.new_group(list(range(t, world, tp_size)))
            ep_group = g if rank % tp_size == t else ep_group
    host_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _current = Parallel(tp_size, rank % tp_size, ep_size, rank // tp_size, tp_group, ep_group, host_group, backend)
    return _current


def set_expert_dispatch(mode: str) -> Parallel:
    """How this process's routed experts exchange tokens (every rank of a job sets the same, before its
    model is built): "all_reduce" or "all_to_all" (dayzero/parallel/dispatch.py)."""
    global _current
    _current = dataclasses.replace(_current, expert_dispatch=check_expert_dispatch(mode))
    return _current


def shutdown() -> None:
    """Leave the job (destroy the process group); current() is SINGLE again."""
    global _current
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _current = SINGLE
