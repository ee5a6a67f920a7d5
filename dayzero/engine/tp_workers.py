"""The other ranks of a parallel engine: processes 1 .. tp x ep - 1 (dayzero.parallel.state), each holding
its share of the model (dayzero/models/sharded.py) and of the KV cache, running every step rank 0 runs.

Rank 0 is the engine's process: it schedules, builds each step's host description (`StepMessage`: state
copies, the sequences' tokens, positions and block tables, whether it replays a decode graph) and
broadcasts it; every rank then runs the same packed forward (`runner.run_step`) on its shares, the
collectives inside the forward keeping them in step, and rank 0 samples from the gathered logits. With
async scheduling a decode's input id may still be on rank 0's device: rank 0 then broadcasts the last
step's sampled ids on the device (`comm.broadcast`, after the message), which every rank patches into its
input ids. A worker's life, in the order rank 0 does the same:

    join the job (dayzero.parallel.init_process)      the run's WorkerArgs from rank 0
    load its shard       attach the expert workspace   the cache layout's probe forward (collectives
    with rank 0's)       the pool's sizes from rank 0  capture the decode graphs (every rank the same
    buckets, each bucket agreed on by all)             then each step's message until rank 0 sends None

Launch (dayzero.parallel.launch): on one node rank 0 spawns the others; on several nodes node k > 0's
command spawns its ranks (`supervise`); under torchrun every process is started for us (`run_worker`).

Failure: a worker that raises sends its error text to rank 0 over a pipe and exits 1; a worker whose
parent died exits. On rank 0 a monitor thread waits on the spawned processes: the first that exits while
the job runs sets `Workers.failure` ("rank r (pid p) exited with code c: <its error>"), aborts the
NCCL process group (so that a collective waiting on the dead rank returns instead of hanging) and calls
the `on_failure` callbacks (the server reports it and exits); rank 0's step then raises `RankFailure`.
Ranks on other nodes or started by torchrun are seen through their collectives failing.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from dayzero.parallel import comm, init_process, shutdown
from dayzero.parallel.launch import Launch
from dayzero.parallel.state import set_expert_dispatch

log = logging.getLogger(__name__)
FAILURE_WAIT_S = 5.0  # how long a failed step waits for the monitor to name the rank that failed
PARENT_POLL_S = 1.0


class RankFailure(RuntimeError):
    """A rank of the job failed (an exception in it, or its process died): the job cannot go on."""


@dataclass(frozen=True)
class PoolConfig:
    """The KV pool every rank allocates (rank 0 sizes it; the others' pages hold their heads)."""

    blocks: list[int]
    block_size: int
    max_num_seqs: int
    num_snapshots: int
    max_model_len: int = 0
    graphs: str | None = None  # decode graphs: "capture" (CUDA), "static" (the padded step, eagerly) or None


@dataclass(frozen=True)
class WorkerArgs:
    """What every worker needs of the run, sent by rank 0 once all have joined."""

    path: str
    dtype: torch.dtype
    kv_cache_dtype: str
    fp8_workspace_gib: float | None
    max_num_batched_tokens: int
    load_threads: int | None
    expert_dispatch: str = "all_reduce"


class Workers:
    """Rank 0's handle on ranks 1 .. tp x ep - 1: sends them each step, watches the ones it spawned."""

    def __init__(self, tp: int, ep: int, procs: dict[int, mp.Process], errors: dict[int, object]):
        self.tp, self.ep, self.procs, self.errors = tp, ep, procs, errors
        self.closed = False
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._monitor = threading.Thread(target=self._watch, name="dayzero-ranks", daemon=True)
        self._monitor.start()

    @property
    def size(self) -> int:
        return self.tp * self.ep

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def configure(self, pool: PoolConfig) -> None:
        self._broadcast(pool)

    def send(self, message, pending: torch.Tensor | None = None) -> None:
        """The step's message, then (async scheduling) the last step's sampled ids still on the device."""
        self._broadcast(message)
        if pending is not None:
            comm.broadcast(pending)

    def _broadcast(self, obj) -> None:
        self.check()
        try:
            comm.broadcast_objects([obj])
        except Exception as exc:
            raise self.failed_step(exc) from exc

    def check(self) -> None:
        """RankFailure when a rank has failed."""
        if self.failure is not None:
            raise RankFailure(self.failure)

    def failed_step(self, exc: BaseException) -> BaseException:
        """What a step that raised `exc` raises: RankFailure naming the rank when one failed (waiting a
        moment for the monitor to see it), else exc itself."""
        if isinstance(exc, RankFailure):
            return exc
        self._failed.wait(FAILURE_WAIT_S if self.procs else 0)
        if self.failure is None:  # rank 0's own error, or a rank we did not start (another node, torchrun)
            self._fail(f"a step failed on rank 0 and left the ranks out of step: {type(exc).__name__}: {exc}")
        return RankFailure(self.failure)

    def _watch(self) -> None:
        """Monitor thread: the first spawned process to exit while the job runs is a failure."""
        sentinels = {p.sentinel: rank for rank, p in self.procs.items()}
        while sentinels and not self.closed:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if self.closed:
                return
            if ready:
                rank = sentinels[ready[0]]
                p = self.procs[rank]
                p.join(1)
                self._fail(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}" + self._error_of(rank))
                return

    def _error_of(self, rank: int) -> str:
        conn = self.errors.get(rank)
        try:
            if conn is not None and conn.poll(0.5):
                return f": {conn.recv()}"
        except (EOFError, OSError):
            pass
        return ""

    def _fail(self, failure: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
        log.error("tensor/expert-parallel job failed: %s", failure)
        _abort_device_group()
        self._failed.set()
        for callback in list(self.on_failure):
            try:
                callback(failure)
            except Exception:  # a callback's error must not hide the failure
                log.exception("on_failure callback failed")

    def abandon(self, exc: BaseException) -> BaseException:
        """Rank 0 cannot go on after `exc` (at start-up): end the workers without telling them; returns what
        to raise: RankFailure when a worker's death caused it, else exc."""
        if isinstance(exc, RuntimeError) and self.procs:  # a collective's error: did a worker die?
            self._failed.wait(FAILURE_WAIT_S)
        cause = self.failure
        self._fail(f"rank 0 stopped: {type(exc).__name__}: {exc}")
        self.close()
        return RankFailure(cause) if cause is not None else exc

    def close(self) -> None:
        """Stop the workers (they leave the job) and leave it too; after a failure, end them at once."""
        if self.closed:
            return
        broken = self.failure is not None
        self.closed = True
        try:
            if not broken:
                comm.broadcast_objects([None])
        except Exception:
            broken = True
        finally:
            for p in self.procs.values():
                p.join(timeout=2 if broken else 30)
                if p.is_alive():
                    p.terminate()
                    p.join(5)
            try:
                shutdown()
            except Exception:  # after a failure the groups may not leave cleanly; the process can go on
                if not broken:
                    raise
                log.warning("leaving the failed job's process group raised", exc_info=True)


def _abort_device_group() -> None:
    """Make collectives waiting on a dead rank return (NCCL waits for ever otherwise; gloo sees the
    closed connection by itself)."""
    from dayzero.parallel import current

    if current().backend != "nccl":
        return
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception:  # best effort: the process is failing anyway
        log.exception("could not abort the NCCL process group")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(ranks: list[int], tp: int, ep: int, init: str, launch: Launch, device_kind: str):
    ctx = mp.get_context("spawn")
    procs, errors = {}, {}
    for rank in ranks:
        recv, send = ctx.Pipe(duplex=False)
        procs[rank] = ctx.Process(target=run_worker, name=f"dayzero-rank{rank}", daemon=True,
                                  args=(rank, tp, ep, init, launch.device(device_kind, rank, tp * ep), send, os.getpid()))
        errors[rank] = recv
    for p in procs.values():
        p.start()
    return procs, errors


def start(tp: int, ep: int, device: str, args: WorkerArgs, launch: Launch = Launch()) -> Workers:
    """Rank 0: spawn this node's other ranks, join the job, send the run's WorkerArgs (returns once every
    rank has joined)."""
    world = tp * ep
    launch.check(world)
    kind = torch.device(device).type
    init = launch.init_method(free_port())
    procs, errors = _spawn(launch.spawned_ranks(world), tp, ep, init, launch, kind)
    try:
        init_process(tp, ep, 0, init, launch.device(kind, 0, world))
    except BaseException:
        for p in procs.values():
            p.terminate()
        raise
    workers = Workers(tp, ep, procs, errors)
    workers.configure(args)
    return workers


def run_ranks_here(tp: int, ep: int, device: str, launch: Launch) -> int:
    """A process that is not rank 0 (node k > 0's command, torchrun's RANK > 0): run this node's worker
    ranks until rank 0 ends the job; returns the exit code."""
    if launch.torchrun:
        world = tp * ep
        launch.check(world)
        run_worker(launch.torchrun_rank, tp, ep, launch.init_method(), launch.device(torch.device(device).type,
                   launch.torchrun_rank, world))
        return 0
    return supervise(tp, ep, device, launch)


def supervise(tp: int, ep: int, device: str, launch: Launch) -> int:
    """Node k > 0 of a multi-node job: spawn its ranks and wait on them; the first to fail ends the rest.
    Returns the exit code (0 when every rank ended as rank 0 told it)."""
    world = tp * ep
    launch.check(world)
    procs, _ = _spawn(launch.spawned_ranks(world), tp, ep, launch.init_method(), launch, torch.device(device).type)
    code = 0
    try:
        pending = {p.sentinel: p for p in procs.values()}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                p = pending.pop(sentinel)
                p.join()
                if p.exitcode:
                    code = 1
                    log.error("%s (pid %s) exited with code %s; ending this node's other ranks", p.name, p.pid, p.exitcode)
                    for q in pending.values():
                        q.terminate()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
    return code


def _watch_parent(parent_pid: int) -> None:
    """A worker's thread: exit when the process that spawned it is gone (it cannot tell us to)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_worker(rank: int, tp: int, ep: int, init: str, device: str, error_conn=None, parent_pid: int | None = None) -> None:
    """A worker rank's whole life (the target of the spawned processes, and torchrun's ranks > 0)."""
    from dayzero.cache.paged import PagedKVStorage, checked_layout
    from dayzero.cache.step import HostTables
    from dayzero.engine.graphs import DecodeGraphs, GraphCaptureError
    from dayzero.engine.runner import pending_patch, run_step
    from dayzero.engine.workspace import attach_expert_workspace
    from dayzero.models import load_model

    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (tp * ep)))
    try:
        init_process(tp, ep, rank, init, device)
        args: WorkerArgs = comm.broadcast_objects(None)[0]
        if args is None:  # rank 0 gave up before the load
            return
        set_expert_dispatch(args.expert_dispatch)
        model = load_model(Path(args.path), device=device, dtype=args.dtype, progress=False, threads=args.load_threads)
        attach_expert_workspace(model, args.fp8_workspace_gib, args.max_num_batched_tokens)
        layout = checked_layout(model, args.kv_cache_dtype)
        pool = comm.broadcast_objects(None)[0]
        storage = PagedKVStorage(layout, pool.blocks, pool.block_size, pool.max_num_seqs, pool.num_snapshots,
                                 model.device_, scratch=True)
        tables = defaultdict(HostTables)
        graphs = None
        if pool.graphs is not None:
            try:  # in step with rank 0's capture: the same buckets, each agreed on (comm.first_error)
                graphs = DecodeGraphs(model, storage, pool.block_size, pool.max_num_seqs, pool.max_model_len,
                                      capture=pool.graphs == "capture", agree=comm.first_error)
            except GraphCaptureError:  # on every rank alike: rank 0 logs why, steps run eagerly
                graphs = None
        with torch.no_grad():
            while (message := comm.broadcast_objects(None)[0]) is not None:
                patch = None
                if message.pending is not None:
                    rows, src, n = message.pending
                    tokens = comm.broadcast(torch.empty(n, dtype=torch.long, device=model.device_))
                    patch = pending_patch(rows, src, tokens, model.device_)
                run_step(model, storage, pool.block_size, tables, message, patch, graphs)
    except BaseException as exc:
        text = f"{type(exc).__name__}: {exc}"
        log.error("rank %d failed: %s\n%s", rank, text, traceback.format_exc())
        if error_conn is not None:
            try:
                error_conn.send(text)
            except OSError:
                pass
        os._exit(1)  # not a clean leave: the others' collectives see the closed connection
    shutdown()
