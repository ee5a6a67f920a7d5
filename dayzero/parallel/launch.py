"""How a job of tp x ep processes is launched, and which of its ranks this process is.

Three ways, as SGLang and torchrun users launch:

    one node (default)   this process is rank 0 and spawns ranks 1 .. world - 1 (dayzero.engine.tp_workers)
    several nodes        `--nnodes N --node-rank k --dist-init-addr HOST:PORT` on each node (SGLang's
                         flags): world / N ranks per node, node k's ranks k * world / N ..; node 0's command
                         is rank 0 (it schedules and serves), node k > 0's spawns its ranks and waits on them
    torchrun             `torchrun --nproc-per-node N -m dayzero CMD ...`: torchrun starts every process,
                         RANK / WORLD_SIZE / LOCAL_RANK (its environment, read here once) say which; RANK 0
                         runs the command, the others the worker loop

Rank r's device is CUDA device r % (ranks per node) (torchrun: LOCAL_RANK), or the CPU with gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dayzero import settings
from dayzero.settings import TORCHRUN_VARIABLES


@dataclass(frozen=True)
class Launch:
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's rendezvous (several nodes)
    torchrun_rank: int | None = None  # RANK, when torchrun started this process
    torchrun_world: int | None = None
    torchrun_local_rank: int | None = None

    def __post_init__(self):
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.torchrun_rank is not None:
            raise ValueError("--nnodes is torchrun's to set when torchrun launches the job; give one or the other")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address, the "
                             "same on every node)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")

    @property
    def torchrun(self) -> bool:
        return self.torchrun_rank is not None

    def check(self, world: int) -> None:
        """ValueError naming the flags when a world of tp x ep processes cannot be launched this way."""
        if self.torchrun and self.torchrun_world != world:
            raise ValueError(f"torchrun started {self.torchrun_world} processes (WORLD_SIZE) but --tp x --ep is "
                             f"{world}; give torchrun --nproc-per-node x --nnodes = {world}")
        if world % self.nnodes:
            raise ValueError(f"--tp x --ep = {world} processes do not split over --nnodes {self.nnodes}")

    def per_node(self, world: int) -> int:
        return world // self.nnodes

    def is_rank0(self) -> bool:
        """Whether this process is rank 0 (the one that schedules and serves)."""
        return self.torchrun_rank == 0 if self.torchrun else self.node_rank == 0

    def spawned_ranks(self, world: int) -> list[int]:
        """The ranks this process starts itself (none under torchrun)."""
        if self.torchrun:
            return []
        n = self.per_node(world)
        first = self.node_rank * n
        return [r for r in range(first, first + n) if r != 0]

    def init_method(self, free_port: int | None = None) -> str:
        if self.torchrun:
            return "env://"
        if self.dist_init_addr is not None:
            return f"tcp://{self.dist_init_addr}"
        return f"tcp://127.0.0.1:{free_port}"

    def device(self, kind: str, rank: int, world: int) -> str:
        """Rank `rank`'s device of type `kind` ("cpu" | "cuda")."""
        if kind != "cuda":
            return "cpu"
        local = self.torchrun_local_rank if self.torchrun and rank == self.torchrun_rank else rank % self.per_node(world)
        return f"cuda:{local}"


def from_torchrun(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The Launch torchrun's environment describes (None: not started by torchrun)."""
    env = settings.launcher_environment() if environ is None else environ
    if not all(v in env for v in TORCHRUN_VARIABLES):
        return None
    try:
        rank, world, local = (int(env[v]) for v in TORCHRUN_VARIABLES)
    except ValueError:
        raise ValueError(f"torchrun's {', '.join(TORCHRUN_VARIABLES)} must be whole numbers, got "
                         f"{[env[v] for v in TORCHRUN_VARIABLES]}") from None
    return Launch(torchrun_rank=rank, torchrun_world=world, torchrun_local_rank=local)


def launch_of(nnodes: int = 1, node_rank: int = 0, dist_init_addr: str | None = None,
              environ: Mapping[str, str] | None = None) -> Launch:
    """The job's Launch from the flags, or torchrun's environment when it started this process."""
    started = from_torchrun(environ)
    if started is not None:
        if nnodes != 1 or node_rank != 0 or dist_init_addr is not None:
            raise ValueError("--nnodes / --node-rank / --dist-init-addr are torchrun's to set when torchrun "
                             "launches the job; give one or the other")
        return started
    return Launch(nnodes, node_rank, dist_init_addr)
