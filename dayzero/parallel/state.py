"""This process's place in a parallel job.

A job of `world` processes, one per device, rank 0 the driver (it runs the scheduler and samples) and
ranks 1 .. world - 1 workers. Tensor parallelism splits attention heads, the dense projections and the
vocabulary over `tp` ranks. `init_process` joins the job (torch.distributed.init_process_group: NCCL on
CUDA, gloo on the CPU) and sets the process-wide `Parallel` that `current()` returns; a process that
never joins is the job of one (`SINGLE`), for which every collective is a no-op.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    tp_rank: int = 0
    group: Any = None  # the tensor-parallel torch.distributed ProcessGroup (None: one process)

    def __post_init__(self):
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {self.tp_rank} is not in a group of size {self.tp_size}")

    @property
    def is_driver(self) -> bool:
        return self.tp_rank == 0

    def split(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of n items (heads, rows, vocabulary entries); `what`
        names them in the error when n does not divide."""
        if n % self.tp_size:
            raise ValueError(f"{what} = {n} does not split over tensor-parallel size {self.tp_size}; "
                             f"choose a --tp that divides it")
        share = n // self.tp_size
        return self.tp_rank * share, (self.tp_rank + 1) * share


SINGLE = Parallel()
_current = SINGLE


def current() -> Parallel:
    """This process's Parallel (SINGLE unless init_process ran)."""
    return _current


def init_process(tp_size: int, rank: int, init_method: str, device: str | torch.device = "cpu",
                 timeout_s: float = 600.0) -> Parallel:
    """Join a job of tp_size processes as `rank` (init_method: torch.distributed's, e.g. tcp://host:port);
    NCCL where the device is CUDA (device index = rank on one node), gloo on the CPU."""
    global _current
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else torch.device("cuda", rank))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if tp_size > 1 or not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=tp_size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _current = Parallel(tp_size, rank, dist.group.WORLD)
    return _current


def shutdown() -> None:
    """Leave the job (destroy the process group); current() is SINGLE again."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = SINGLE
