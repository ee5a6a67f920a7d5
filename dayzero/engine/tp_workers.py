"""The other ranks of a parallel engine: processes 1 .. tp x ep - 1 (dayzero.parallel.state), each holding
its share of the model (dayzero/models/sharded.py) and of the KV cache, running every step rank 0 runs.

Rank 0 is the engine's process: it schedules, builds each step's host description (`StepMessage`: state
copies, the sequences' tokens, positions and block tables) and broadcasts it; every rank then runs the same
packed forward (`runner.run_step`) on its shares, the collectives inside the forward keeping them in
step, and rank 0 samples from the gathered logits. A worker's life, in the order rank 0 does the same:

    join the job (dayzero.parallel.init_process)      load its shard       attach the expert workspace
    the cache layout's probe forward (collectives with rank 0's)           the pool's sizes from rank 0
    then each step's message until rank 0 sends None (LLM.close, or rank 0's exit)

One node: the workers are spawned processes (daemons: they end with rank 0), device rank r for CUDA.
Not yet: CUDA graphs and async scheduling with tensor parallelism (the engine runs such steps eagerly).
"""

from __future__ import annotations

import logging
import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dayzero.parallel import comm, init_process, shutdown

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    """The KV pool every rank allocates (rank 0 sizes it; the others' pages hold their heads)."""

    blocks: list[int]
    block_size: int
    max_num_seqs: int
    num_snapshots: int


@dataclass(frozen=True)
class WorkerArgs:
    path: str
    device: str  # "cpu", or "cuda" (rank r takes device r)
    dtype: torch.dtype
    kv_cache_dtype: str
    fp8_workspace_gib: float | None
    max_num_batched_tokens: int
    load_threads: int | None


class Workers:
    """Rank 0's handle on ranks 1 .. tp x ep - 1."""

    def __init__(self, tp: int, ep: int, procs: list):
        self.tp, self.ep, self.procs, self.closed = tp, ep, procs, False

    @property
    def size(self) -> int:
        return self.tp * self.ep

    def configure(self, pool: PoolConfig) -> None:
        comm.broadcast_objects([pool])

    def send(self, message) -> None:
        comm.broadcast_objects([message])

    def close(self) -> None:
        """Stop the workers (they leave the job) and leave it too."""
        if self.closed:
            return
        self.closed = True
        try:
            comm.broadcast_objects([None])
        finally:
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
            shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tp: int, ep: int, args: WorkerArgs) -> Workers:
    """Spawn ranks 1 .. tp x ep - 1 and join the job as rank 0 (returns once every rank has joined)."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(rank, tp, ep, init, args), daemon=True,
                         name=f"dayzero-rank{rank}") for rank in range(1, tp * ep)]
    for p in procs:
        p.start()
    init_process(tp, ep, 0, init, _rank_device(args.device, 0))
    return Workers(tp, ep, procs)


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else "cpu"


def _worker_main(rank: int, tp: int, ep: int, init: str, args: WorkerArgs) -> None:
    from dayzero.cache.paged import PagedKVStorage, checked_layout
    from dayzero.cache.step import HostTables
    from dayzero.engine.runner import run_step
    from dayzero.models import load_model
    from dayzero.engine.workspace import attach_expert_workspace

    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (tp * ep)))
    device = _rank_device(args.device, rank)
    init_process(tp, ep, rank, init, device)
    try:
        model = load_model(Path(args.path), device=device, dtype=args.dtype, progress=False, threads=args.load_threads)
        attach_expert_workspace(model, args.fp8_workspace_gib, args.max_num_batched_tokens)
        layout = checked_layout(model, args.kv_cache_dtype)
        pool = comm.broadcast_objects(None)[0]
        storage = PagedKVStorage(layout, pool.blocks, pool.block_size, pool.max_num_seqs, pool.num_snapshots,
                                 model.device_, scratch=True)
        tables = defaultdict(HostTables)
        with torch.no_grad():
            while (message := comm.broadcast_objects(None)[0]) is not None:
                run_step(model, storage, pool.block_size, tables, message)
    finally:
        shutdown()
