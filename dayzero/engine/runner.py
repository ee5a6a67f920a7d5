"""The model runner: executes one scheduled step as one packed forward.

Every scheduled request's new tokens (decodes first, then prefill chunks) go into one [num_tokens]
row; `dayzero.cache.step.build_step` turns the requests' block tables, positions and state slots into
one metadata object (one host-to-device transfer), the model writes each new cache entry into the
block pool and its attention ops read the pool in place (dayzero.cache.paged). The forward returns
logits only for the requests whose step reaches their last known token.

Models with recurrent state (KDA, DeepSeek-V4's compressors) get a state slot per running request;
a fresh request's slot starts from zeros. With prefix caching on, the runner saves the state
whenever a request's computed tokens reach a block boundary (the scheduler ends prefill chunks at
block boundaries for such models: `Scheduler.align_chunks`) under that prefix's block hash, and a
request admitted with a cached prefix resumes from the saved state (dayzero.cache.snapshots).

With `encoder` set (dayzero.engine.encoder.ImageEncoder: vision-language models), the step's image
placeholder tokens get their images' features (encoded first where the feature cache lacks them) in
place of their embeddings (`cache.mm_embeds`); such a step runs eagerly.

With `graphs` set (dayzero.engine.graphs.DecodeGraphs, made by the engine on CUDA), a decode-only
step of up to its largest bucket replays a captured CUDA graph instead of building the metadata and
running the forward eagerly; `num_graph_steps` counts those.

A step that raises leaves no host bookkeeping behind: the state slots it handed out go back and the
snapshots it meant to save are forgotten (their states may not have been written); what it wrote to
the device is the engine's to handle (it preempts or fails the step's requests: docs/engine.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from dayzero.cache import KVCacheManager
from dayzero.cache.paged import PagedKVStorage, PagedStepCache
from dayzero.cache.snapshots import SnapshotCache
from dayzero.cache.step import HostTables, SeqStep, build_step
from dayzero.engine.request import PENDING
from dayzero.engine.scheduler import ScheduledRequest, SchedulerOutput
from dayzero.models import CausalLM


class PagedRunner:
    def __init__(self, model: CausalLM, kv: KVCacheManager, storage: PagedKVStorage,
                 snapshots: SnapshotCache | None = None):
        self.model, self.kv, self.storage, self.snapshots = model, kv, storage, snapshots
        self.device = model.device_
        self.stateful = bool(storage.states)
        self.slots: dict[str, int] = {}  # request -> its state slot
        self._free_slots = list(range(storage.num_state_slots - 1, -1, -1))
        self.num_forwards = 0
        self.num_tokens = 0
        self.graphs = None  # DecodeGraphs, when decode steps replay CUDA graphs
        self.host_tables = defaultdict(HostTables)  # per cache group: tables converted incrementally
        self.num_graph_steps = 0
        self.peers = None  # the other tensor-parallel ranks (dayzero.engine.tp_workers.Workers), when any
        self.encoder = None  # dayzero.engine.encoder.ImageEncoder, for models that read images
        self.faults = None  # a dayzero.engine.faults.FaultInjector (tests): makes chosen steps raise

    @torch.no_grad()
    def execute(self, output: SchedulerOutput, pending: tuple[list[str], torch.Tensor] | None = None
                ) -> tuple[list[str], torch.Tensor | None]:
        """Run the step; returns the ids of the requests to sample for (those whose step reaches their
        last known token) and their float32 logits [len(ids), vocab] (None when there are none).
        pending (async scheduling): (request ids, their sampled ids on the device) of the previous step,
        whose values the host does not have yet: an input token given as PENDING is read from there."""
        for rid in output.preempted:
            self.free(rid)
        new_slots: list[str] = []  # requests given a state slot by this step
        saved: list = []  # block hashes this step saves a snapshot under
        try:
            return self._execute(output, pending, new_slots, saved)
        except BaseException:  # the step failed: nothing it set up on the host stays (the engine recovers)
            for rid in new_slots:
                self.free(rid)
            for block_hash in saved:  # its state may not have been written
                self.snapshots.discard(block_hash)
            raise

    def _execute(self, output: SchedulerOutput, pending, new_slots: list[str], saved: list):
        restores = []  # (snapshot slot, state slot): every resumed state, restored before the forward
        for s in output.scheduled:
            rid = s.request.request_id
            if rid not in self.slots:
                if not self._free_slots:
                    raise RuntimeError(f"no state slot for request {rid!r}: more running requests than max_num_seqs")
                self.slots[rid] = self._free_slots.pop()
                new_slots.append(rid)
                if s.num_computed_tokens and self.stateful:
                    restores.append(self._restore(s))
        if not output.scheduled:
            return [], None
        order = sorted(output.scheduled, key=lambda s: s.num_new_tokens != 1 or not s.num_computed_tokens)  # decodes first
        steps = [SeqStep(s.num_computed_tokens, s.num_new_tokens, self.kv.block_tables[s.request.request_id],
                         self.slots[s.request.request_id], s.samples,
                         s.request.token_ids(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
                 for s in order]
        snapshots = []  # (state slot, snapshot slot): states saved after the forward, at block boundaries
        if self.stateful and self.snapshots is not None:
            for s in order:
                done = s.num_computed_tokens + s.num_new_tokens
                if done % self.kv.block_size == 0:
                    snapshots += self._snapshot(s, done, saved)
        inputs = self._pending_inputs(order, steps, pending)
        graph = self.graphs is not None and self.graphs.takes(steps)
        message = StepMessage(restores, steps, snapshots, graph,
                              None if inputs is None else (*inputs, len(pending[0])))
        patch = None if inputs is None else pending_patch(*inputs, pending[1], self.device)
        mm_embeds = None if self.encoder is None else self.encoder.step_inputs(order)
        if self.peers is None or mm_embeds is not None:  # (images' features: vision models run in one process)
            logits = self._run(message, patch, mm_embeds)
        else:  # the other tensor-parallel ranks run the same step on their shares
            try:
                self.peers.send(message, None if inputs is None else pending[1])
                logits = self._run(message, patch)
            except Exception as exc:  # the job is broken: its ranks are out of step
                raise self.peers.failed_step(exc) from exc
        self.num_forwards += 1
        self.num_tokens += sum(s.num_new for s in steps)
        return [s.request.request_id for s in order if s.samples], logits if logits.shape[0] else None

    def _run(self, message: StepMessage, patch, mm_embeds=None) -> torch.Tensor:
        self.num_graph_steps += message.graph
        logits = run_step(self.model, self.storage, self.kv.block_size, self.host_tables, message, patch, self.graphs,
                          mm_embeds)
        if self.faults is not None:  # after the forward: the step has written its entries and states
            self.faults.check()
        return logits

    def _pending_inputs(self, order: list[ScheduledRequest], steps: list[SeqStep], pending
                        ) -> tuple[list[int], list[int]] | None:
        """None, or (rows, src): the PENDING input tokens of `steps` (each the last token of a decode row):
        row rows[i] of the step's input ids takes the previous step's sampled id src[i]."""
        rows, src, row = [], [], 0
        where = None
        for o, s in zip(order, steps):
            if PENDING in s.token_ids:
                if pending is None or s.token_ids.index(PENDING) != s.num_new - 1:
                    raise RuntimeError("a step's input token is still on the device but no previous step holds it")
                if where is None:
                    where = {rid: i for i, rid in enumerate(pending[0])}
                rows.append(row + s.num_new - 1)
                src.append(where[o.request.request_id])
            row += s.num_new
        return (rows, src) if rows else None

    @property
    def num_requests(self) -> int:
        """Requests holding a state slot (running or mid-prefill)."""
        return len(self.slots)

    def free(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    # -- recurrent-state snapshots ----------------------------------------------------------------
    def _snapshot(self, s: ScheduledRequest, num_tokens: int, saved: list) -> list[tuple[int, int]]:
        """Where to save the request's state after its first num_tokens tokens (a block boundary): [] or
        [(its state slot, the snapshot's slot)]; its hash is appended to `saved`."""
        block_hash = self.kv.block_hashes(s.request, num_tokens // self.kv.block_size)[-1]
        slot = self.snapshots.insert(block_hash)
        saved.append(block_hash)
        return [] if slot is None else [(self.slots[s.request.request_id], self.storage.num_state_slots + slot)]

    def _restore(self, s: ScheduledRequest) -> tuple[int, int]:
        """(the snapshot's slot, the request's state slot) to copy before the step."""
        block_hash = self.kv.block_hashes(s.request, s.num_computed_tokens // self.kv.block_size)[-1]
        slot = None if self.snapshots is None else self.snapshots.lookup(block_hash)
        if slot is None:
            raise RuntimeError(f"request {s.request.request_id!r} resumes at token {s.num_computed_tokens} but no "
                               f"state snapshot exists there; the KV manager must only match snapshotted prefixes")
        return self.storage.num_state_slots + slot, self.slots[s.request.request_id]


@dataclass
class StepMessage:
    """One step as every rank runs it (host values only, picklable: what rank 0 sends the others)."""

    restores: list[tuple[int, int]]  # state copies (src, dst) before the forward
    steps: list[SeqStep]
    snapshots: list[tuple[int, int]]  # state copies (src, dst) after it
    graph: bool = False  # runs as the decode graphs' padded static step (a replay where captured)
    # async scheduling: (rows, src, n): input row rows[i] takes sampled id src[i] of the previous step's n,
    # which are still on the device (the other ranks receive them from rank 0: comm.broadcast)
    pending: tuple[list[int], list[int], int] | None = None


def pending_patch(rows: list[int], src: list[int], tokens: torch.Tensor, device: torch.device):
    """A function writing `tokens[src]` (ids still on the device) into rows `rows` of a step's input ids."""
    index = torch.tensor([rows, src], dtype=torch.long, pin_memory=device.type == "cuda")
    index = index.to(device, non_blocking=True)

    def patch(input_ids: torch.Tensor) -> None:
        input_ids[index[0]] = tokens[index[1]]
    return patch


def run_step(model: CausalLM, storage: PagedKVStorage, block_size: int, host_tables, message: StepMessage,
             patch=None, graphs=None, mm_embeds=None) -> torch.Tensor:
    """The step on this rank: restore states, one packed forward (the logits of the sampled rows), save
    snapshots. patch: writes pending input ids into the step's device ids (async scheduling); graphs: the
    DecodeGraphs a `message.graph` step runs through (a replay) instead of the eager forward; mm_embeds:
    the forward's cache.mm_embeds (images' features, dayzero/engine/encoder.py)."""
    for src, dst in message.restores:
        storage.copy_state(src, dst)
    if message.graph:
        if graphs is None:
            raise RuntimeError("the step runs as a decode graph but this rank has none (its capture failed?)")
        logits = graphs.run(message.steps, patch)
    else:
        meta = build_step(message.steps, storage.layout, block_size, model.device_, host_tables)
        if patch is not None:
            patch(meta.input_ids)
        cache = PagedStepCache(storage, meta, model.spec.num_layers)
        cache.mm_embeds = mm_embeds
        logits = model.forward_packed(meta.input_ids, meta.positions, cache)
    for src, dst in message.snapshots:
        storage.copy_state(src, dst)
    return logits
