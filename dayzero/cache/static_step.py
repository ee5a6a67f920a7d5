"""Decode-step metadata at fixed addresses, for CUDA graphs (dayzero.engine.graphs).

A captured graph replays the kernels with the device pointers they had at capture, so the step's
metadata must live in buffers that never move: `StaticStep` holds, for up to `max_seqs` sequences
each computing one token, the same fields as `dayzero.cache.step.StepMetadata` (input ids,
positions, query starts, sequence lengths, one int32 block table per cache group of fixed width,
where each new entry goes, state slots, logits rows; and for streams of compressed entries, one
candidate slot per sequence: `StepMetadata.candidates`) in one device buffer, mirrored by one pinned
host buffer. `meta(b, seq_lens_host)` gives the StepMetadata of a batch of b sequences as views of
those buffers (made once per bucket and captured with); `fill(steps, b)` writes a step's values
(n <= b sequences, the rest padding) and copies them to the device in one transfer (the 1-D fields,
then the tables; of the last table only the first b rows).

Padding sequences compute one token at position 0 of id 0, read and write only the storage's scratch
page of each group (`PagedKVStorage.scratch_pages`) and its scratch state slot, so they never touch
a request's cache. Only the first `n` logits rows mean anything.

Stale table entries past a sequence's pages are not cleared: attention kernels read only the pages
covering [0, seq_len) (and sliding-window kernels fewer), so what lies beyond is never read. For the
same reason a row that holds the same request's table as last step gets only the table's new tail
written (a table only grows while its request runs; an entry reclaimed out of a window keeps its old
page id, which no kernel reads again): a step's host work does not grow with the context.

Host values in `meta` (the SeqBatch host tuples) choose the kernels' launch shapes (split counts,
tiles) when the graph is captured; the kernels read the real lengths from the device buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from dayzero.cache.step import SeqStep, StepMetadata
from dayzero.ops.paged import SeqBatch

_LONGS = ("input_ids", "positions", "state_slots", "logits_indices")


class StaticStep:
    def __init__(self, layout, block_size: int, max_seqs: int, max_len: int, scratch_pages: list[int],
                 scratch_slot: int, device: torch.device | str):
        """max_len: tokens a sequence holds at most (max_model_len); its table holds that many pages."""
        self.device = torch.device(device)
        self.block_size, self.max_seqs, self.max_len = block_size, max_seqs, max_len
        self.width = -(-max_len // block_size) + 1  # one spare column, as build_step's tables
        kinds = layout.stream_kinds(block_size)
        self.groups = sorted({g for g, _, _ in kinds})
        self.compressed = sorted((g, rate, per_block) for g, rate, per_block in kinds if rate > 1)
        self.scratch_pages, self.scratch_slot = scratch_pages, scratch_slot
        s, w = max_seqs, self.width
        longs = list(_LONGS) + [f"w{p}{g}" for g in self.groups for p in "po"]
        longs += [f"c{p}{g},{rate}" for g, rate, _ in self.compressed for p in "po"]
        self._spans: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name in longs:
            self._spans[name] = (offset, (s,), torch.int64)
            offset += 8 * s
        for name, shape in (("query_start", (s + 1,)), ("seq_lens", (s,))):
            self._spans[name] = (offset, shape, torch.int32)
            offset += 4 * int(np.prod(shape))
        self._flat_bytes = -(-offset // 8) * 8  # the 1-D fields: one transfer
        offset = self._flat_bytes
        for g in self.groups:
            self._spans[f"table{g}"] = (offset, (s, w), torch.int32)
            offset += 4 * s * w
        self.nbytes = offset
        self._device_buf = torch.zeros(offset, dtype=torch.uint8, device=self.device)
        self._host_buf = torch.zeros(offset, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.dev = {name: self._view(self._device_buf, name) for name in self._spans}
        self.host = {name: self._view(self._host_buf, name).numpy() for name in self._spans}
        self.host["query_start"][:] = np.arange(s + 1)
        self.host["logits_indices"][:] = np.arange(s)
        self._copied: torch.cuda.Event | None = None
        # per group and row: the table list written there last and how many of its entries (tables only
        # grow while a request runs, and reclaimed entries are never read again: only the tail is new)
        self._owner = {g: [None] * s for g in self.groups}
        self._written = {g: [0] * s for g in self.groups}
        self.fill([], s)  # every row padding: what capture runs on

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        offset, shape, dtype = self._spans[name]
        size = int(np.prod(shape)) * (8 if dtype == torch.int64 else 4)
        return buf[offset:offset + size].view(dtype).view(shape)

    def meta(self, b: int, seq_lens_host: tuple[int, ...] | None = None) -> StepMetadata:
        """The StepMetadata of a b-sequence decode step over the device buffers. seq_lens_host: the host
        lengths the kernels plan with (default: max_len for every sequence)."""
        if not 1 <= b <= self.max_seqs:
            raise ValueError(f"StaticStep.meta: batch {b} outside [1, {self.max_seqs}]")
        if seq_lens_host is None:
            seq_lens_host = (self.max_len,) * b
        d = self.dev
        seqs = SeqBatch(d["query_start"][:b + 1], d["seq_lens"][:b], tuple(range(b + 1)), tuple(seq_lens_host))
        writes = {(g, 1): (d[f"wp{g}"][:b], d[f"wo{g}"][:b]) for g in self.groups}
        candidates = {(g, r): (d[f"cp{g},{r}"][:b], d[f"co{g},{r}"][:b]) for g, r, _ in self.compressed}
        return StepMetadata(d["input_ids"][:b], d["positions"][:b], seqs, {g: d[f"table{g}"][:b] for g in self.groups},
                            writes, d["state_slots"][:b], d["logits_indices"][:b], (False,) * b,
                            (self.scratch_slot,) * b, candidates)

    def fill(self, steps: list[SeqStep], b: int) -> None:
        """Write the values of `steps` (decodes: one new token each, tables covering it) as the first
        len(steps) of b sequences, pad the rest, and copy them to the device (stream-ordered)."""
        n = len(steps)
        if n > b or b > self.max_seqs:
            raise ValueError(f"StaticStep.fill: {n} sequences in a batch of {b} (at most {self.max_seqs})")
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the previous step's transfer must have read the host buffer
        h, bs = self.host, self.block_size
        starts = np.fromiter((s.start for s in steps), dtype=np.int64, count=n)
        if any(s.num_new != 1 or s.token_ids is None or len(s.token_ids) != 1 for s in steps):
            raise ValueError("StaticStep.fill: every sequence of a graph step computes exactly one given token")
        h["input_ids"][:n] = [s.token_ids[0] for s in steps]
        h["input_ids"][n:b] = 0
        h["positions"][:n] = starts
        h["positions"][n:b] = 0
        h["seq_lens"][:n] = starts + 1
        h["seq_lens"][n:b] = 1
        h["state_slots"][:n] = [s.state_slot for s in steps]
        h["state_slots"][n:b] = self.scratch_slot
        for g in self.groups:
            table, scratch = h[f"table{g}"], self.scratch_pages[g]
            owner, written = self._owner[g], self._written[g]
            for i, s in enumerate(steps):
                row = s.tables[g]
                if len(row) >= self.width or s.start >= self.max_len:
                    raise ValueError(f"StaticStep.fill: a sequence at token {s.start} with {len(row)} pages exceeds "
                                     f"the graphs' {self.max_len} tokens ({self.width - 1} pages)")
                lo = written[i] if owner[i] is row and len(row) >= written[i] else 0
                if lo < len(row):
                    table[i, lo:len(row)] = [-1 if p is None else p for p in row[lo:]]
                    table[i, len(row)] = -1
                owner[i], written[i] = row, len(row)
            table[n:b, 0] = scratch
            table[n:b, 1] = -1
            for i in range(n, b):
                owner[i] = None
            page = table[np.arange(n), starts // bs] if n else np.zeros(0, np.int32)
            if (page < 0).any():
                raise RuntimeError(f"a graph step writes cache group {g} entries into a block that is not allocated")
            h[f"wp{g}"][:n], h[f"wp{g}"][n:b] = page, scratch
            h[f"wo{g}"][:n], h[f"wo{g}"][n:b] = starts % bs, 0
        for g, rate, per_block in self.compressed:  # each row's candidate entry: its slot where it completes
            table, scratch = h[f"table{g}"], self.scratch_pages[g]
            completes = (starts + 1) % rate == 0
            token = np.where(completes, starts, 0)  # the completing token: the entry's last (its page's)
            page = table[np.arange(n), token // bs].astype(np.int64) if n else np.zeros(0, np.int64)
            if (completes & (page < 0)).any():
                raise RuntimeError(f"a graph step writes cache group {g} entries into a block that is not allocated")
            h[f"cp{g},{rate}"][:n] = np.where(completes, page, scratch)
            h[f"co{g},{rate}"][:n] = np.where(completes, (token % bs) // rate if per_block > 1 else 0, 0)
            h[f"cp{g},{rate}"][n:b], h[f"co{g},{rate}"][n:b] = scratch, 0
        # one transfer: the 1-D fields, every table but the last in full and the last one's first b rows
        end = self._spans[f"table{self.groups[-1]}"][0] + 4 * b * self.width if self.groups else self._flat_bytes
        cuda = self.device.type == "cuda"
        self._device_buf[:end].copy_(self._host_buf[:end], non_blocking=cuda)
        if cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
