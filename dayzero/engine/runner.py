"""The model runner: executes one scheduled step on the model.

`PagedRunner`: the models' caches (streams and states, dayzero.cache.paged) live in the block pool's
pages and each step is at most a few forwards:
- the **prefill path**: each request that computes several tokens (or its first) runs alone, [1, T],
  reading its whole cache through its block tables;
- the **decode path**: every request that computes one token after cached ones runs in one forward
  [B, 1], each row reading its own blocks (right-aligned, padded rows masked with `kv_lens`).
Models with recurrent state (KDA) get a state slot per running request; with prefix caching on, the
runner saves the state whenever a request's computed tokens reach a block boundary (a prefill chunk
is split there) under that prefix's block hash, and a request admitted with a cached prefix resumes
from the saved state (dayzero.cache.snapshots).

Rows that append a compressed entry (DeepSeek-V4, one per ratio tokens) decode in a forward apart
from rows that do not: one forward per combination of the ratios a row completes (at most 4 for
DeepSeek-V4's CSA and HCA), whatever the batch.
"""

from __future__ import annotations

import torch

from dayzero.cache import KVCacheManager
from dayzero.cache.paged import PagedKVStorage, PagedStepCache, build_step
from dayzero.cache.snapshots import SnapshotCache
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
        self.num_prefill_forwards = 0
        self.num_decode_forwards = 0
        self.num_decode_rows = 0

    @torch.no_grad()
    def execute(self, output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run the step; returns float32 logits [vocab] of the last computed position of every
        request whose step reaches its last known token (the ones to sample for)."""
        for rid in output.preempted:
            self.free(rid)
        prefills: list[ScheduledRequest] = []
        decodes: list[ScheduledRequest] = []
        for s in output.scheduled:  # restore every resumed state before any snapshot of this step
            rid = s.request.request_id
            if rid not in self.slots:
                if not self._free_slots:
                    raise RuntimeError(f"no state slot for request {rid!r}: more running requests than max_num_seqs")
                self.slots[rid] = self._free_slots.pop()
                if s.num_computed_tokens and self.stateful:
                    self._restore(s)
            (decodes if s.num_new_tokens == 1 and s.num_computed_tokens else prefills).append(s)
        logits: dict[str, torch.Tensor] = {}
        for s in prefills:
            self._prefill(s, logits)
        for batch in self._decode_batches(decodes):
            self._decode(batch, logits)
        return logits

    def _decode_batches(self, decodes: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
        """Decode rows in as few forwards as the compressed streams allow: rows that complete an
        entry of every rate r > 1 at the same steps share a forward (one forward without them)."""
        rates = sorted({s.rate for s in self.storage.layout.streams if s.rate > 1})
        batches: dict[tuple[int, ...], list[ScheduledRequest]] = {}
        for s in decodes:
            n = s.num_computed_tokens
            batches.setdefault(tuple((n + 1) // r - n // r for r in rates), []).append(s)
        return list(batches.values())

    @property
    def num_requests(self) -> int:
        """Requests holding a state slot (running or mid-prefill)."""
        return len(self.slots)

    def free(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    # -- paths ------------------------------------------------------------------------------------
    def _prefill(self, s: ScheduledRequest, logits: dict) -> None:
        req, start = s.request, s.num_computed_tokens
        end = start + s.num_new_tokens
        bs = self.kv.block_size
        boundary = end // bs * bs  # the last block boundary the chunk reaches
        saves = self.stateful and self.snapshots is not None and boundary > start
        pieces = [(start, boundary), (boundary, end)] if saves and boundary < end else [(start, end)]
        for a, b in pieces:
            out = self._forward([s], [a], b - a)
            self.num_prefill_forwards += 1
            if saves and b == boundary:
                self._snapshot(s, boundary)
        if s.samples:
            logits[req.request_id] = out[0, -1]

    def _decode(self, batch: list[ScheduledRequest], logits: dict) -> None:
        out = self._forward(batch, [s.num_computed_tokens for s in batch], 1)
        self.num_decode_forwards += 1
        self.num_decode_rows += len(batch)
        for row, s in enumerate(batch):
            if s.samples:
                logits[s.request.request_id] = out[row, -1]
            done = s.num_computed_tokens + 1
            if self.stateful and self.snapshots is not None and done % self.kv.block_size == 0:
                self._snapshot(s, done)

    def _forward(self, batch: list[ScheduledRequest], starts: list[int], num_new: int) -> torch.Tensor:
        tables = [self.kv.block_tables[s.request.request_id] for s in batch]
        ctx = build_step(tables, starts, num_new, self.storage.layout, self.kv.block_size,
                         [self.slots[s.request.request_id] for s in batch], self.device)
        ids = torch.tensor([s.request.token_ids(a, a + num_new) for s, a in zip(batch, starts)], device=self.device)
        positions = torch.tensor([list(range(a, a + num_new)) for a in starts], device=self.device)
        return self.model(ids, positions, PagedStepCache(self.storage, ctx, self.model.spec.num_layers))

    # -- recurrent-state snapshots ----------------------------------------------------------------
    def _snapshot(self, s: ScheduledRequest, num_tokens: int) -> None:
        """Save the request's state after its first num_tokens tokens (a block boundary)."""
        block_hash = self.kv.block_hashes(s.request, num_tokens // self.kv.block_size)[-1]
        slot = self.snapshots.insert(block_hash)
        if slot is not None:
            self.storage.copy_state(self.slots[s.request.request_id], self.storage.num_state_slots + slot)

    def _restore(self, s: ScheduledRequest) -> None:
        block_hash = self.kv.block_hashes(s.request, s.num_computed_tokens // self.kv.block_size)[-1]
        slot = None if self.snapshots is None else self.snapshots.lookup(block_hash)
        if slot is None:
            raise RuntimeError(f"request {s.request.request_id!r} resumes at token {s.num_computed_tokens} but no "
                               f"state snapshot exists there; the KV manager must only match snapshotted prefixes")
        self.storage.copy_state(self.storage.num_state_slots + slot, self.slots[s.request.request_id])
