"""The step metadata: everything one packed forward needs to read and write the paged cache, built
once per step on the host and moved to the device in one transfer.

A step computes, for each scheduled sequence b (decodes first, then prefill chunks, as the runner
orders them), its tokens [start_b, start_b + num_new_b). All of them are packed into one
[num_tokens] row. `StepMetadata` carries
    input_ids, positions      long [num_tokens] (input_ids empty when the caller passes its own)
    seqs                      SeqBatch: query_start int32 [B + 1], seq_lens int32 [B] (+ host tuples)
    block_tables[g]           int32 [B, max blocks] per cache group g (-1: reclaimed or unallocated)
    writes[g, rate]           (pages, offsets) long [M]: where the step's new entries of streams of
                              group g and entry rate `rate` go, sequence by sequence, entry by entry
                              (a sequence appends entries start // rate ... end // rate - 1)
    candidates                (graph decode steps only) one slot per sequence and (g, rate > 1)
    state_slots               long [B]: each sequence's recurrent-state slot
    logits_indices            long [R]: the rows whose logits are wanted (the last token of every
                              sequence that samples), in sequence order
Host-side arithmetic is vectorised with numpy (no Python loop over tokens); the integer arrays are
laid out in one pinned buffer (int64 arrays, then int32 ones) and copied with one non-blocking
transfer; the device tensors are views of that one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dayzero.ops.paged import SeqBatch, entry_token


@dataclass
class SeqStep:
    """One scheduled sequence's part of a step (host values)."""

    start: int  # tokens computed before this step
    num_new: int  # tokens computed by this step
    tables: list[list[int | None]]  # its block table per cache group
    state_slot: int = 0
    sample: bool = True  # logits wanted for its last new token
    token_ids: list[int] | None = None  # the new tokens (None: the caller passes input_ids itself)


@dataclass
class StepMetadata:
    input_ids: torch.Tensor
    positions: torch.Tensor
    seqs: SeqBatch
    block_tables: dict[int, torch.Tensor]
    writes: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    state_slots: torch.Tensor
    logits_indices: torch.Tensor
    fresh: tuple[bool, ...]  # per sequence: no token computed before this step (its state reads as zeros)
    state_slots_host: tuple[int, ...]
    # a graph's decode step (dayzero.cache.static_step): per (group, rate > 1), where each sequence's
    # candidate entry goes, (pages, offsets) long [B]: the entry's slot where its window completes this
    # step, the scratch page elsewhere (a fixed count per step, whatever the windows' phases)
    candidates: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def num_tokens(self) -> int:
        return self.seqs.num_tokens


def _table_array(tables: list[list[int | None]]) -> np.ndarray:
    width = max((len(t) for t in tables), default=0) + 1  # one spare column: reads past the end stay in bounds
    out = np.full((len(tables), width), -1, dtype=np.int32)
    for b, t in enumerate(tables):
        if t:
            row = np.asarray(t, dtype=object)
            out[b, :len(t)] = np.where(row == None, -1, row).astype(np.int32)  # noqa: E711 (elementwise)
    return out


class HostTables:
    """int32 copies of the block tables of the last step's sequences, kept per table list and brought up
    to date in place: a table only grows while its request runs, and the entries a sliding window
    reclaims (None) go from its front, so a step converts only the new tail and the newly reclaimed
    head. The result equals `_table_array`'s. Tables of sequences not in the step are dropped."""

    def __init__(self):
        self._rows: dict[int, list] = {}  # id(table) -> [table, int32 buffer, converted, first live]

    def array(self, tables: list[list[int | None]]) -> np.ndarray:
        width = max((len(t) for t in tables), default=0) + 1
        out = np.full((len(tables), width), -1, dtype=np.int32)
        rows: dict[int, list] = {}
        for b, t in enumerate(tables):
            entry = self._rows.get(id(t))
            if entry is None or entry[0] is not t or len(t) < entry[2]:
                entry = [t, np.empty(max(8, 2 * len(t)), dtype=np.int32), 0, 0]
            _, buf, done, live = entry
            if len(t) > buf.shape[0]:
                buf = np.concatenate([buf[:done], np.empty(2 * len(t) - done, dtype=np.int32)])
            if len(t) > done:
                buf[done:len(t)] = [-1 if p is None else p for p in t[done:]]
            while live < len(t) and t[live] is None:  # reclaimed since (a window's front)
                buf[live] = -1
                live += 1
            entry[1:] = [buf, len(t), live]
            rows[id(t)] = entry
            out[b, :len(t)] = buf[:len(t)]
        self._rows = rows
        return out


def build_step(seqs: list[SeqStep], layout, block_size: int, device: torch.device | str,
               host_tables: dict[int, HostTables] | None = None) -> StepMetadata:
    """The StepMetadata of `seqs`, in their order. A sequence's tables must cover its new tokens.
    host_tables: the runner's HostTables per cache group (a defaultdict), so that tables are converted
    incrementally."""
    device = torch.device(device)
    starts = np.array([s.start for s in seqs], dtype=np.int64)
    counts = np.array([s.num_new for s in seqs], dtype=np.int64)
    ends = starts + counts
    if (counts < 1).any():
        raise ValueError(f"every sequence of a step computes at least one token; got counts {counts.tolist()}")
    query_start = np.concatenate([[0], np.cumsum(counts)])
    n = int(query_start[-1])
    positions = np.arange(n, dtype=np.int64) - np.repeat(query_start[:-1], counts) + np.repeat(starts, counts)
    have_ids = all(s.token_ids is not None for s in seqs)
    ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=n) if have_ids else np.zeros(0, np.int64)

    longs: list[tuple[str, np.ndarray]] = [("input_ids", ids), ("positions", positions)]
    ints: list[tuple[str, np.ndarray]] = [("query_start", query_start.astype(np.int32)),
                                          ("seq_lens", ends.astype(np.int32))]
    tables = {}
    for g, rate, per_block in layout.stream_kinds(block_size):
        if g not in tables:
            rows = [s.tables[g] for s in seqs]
            tables[g] = host_tables[g].array(rows) if host_tables is not None else _table_array(rows)
            ints.append((f"table{g}", tables[g]))
        first, last = starts // rate, ends // rate
        num = last - first
        entry = np.arange(int(num.sum()), dtype=np.int64) - np.repeat(np.cumsum(num) - num, num) + np.repeat(first, num)
        token = entry_token(entry, rate)  # the page of the entry's last token (dayzero.ops.paged)
        pages = tables[g][np.repeat(np.arange(len(seqs)), num), token // block_size].astype(np.int64)
        if (pages < 0).any():
            raise RuntimeError(f"a step writes cache group {g} entries into a block that is not allocated")
        offsets = (token % block_size) // rate if per_block > 1 else np.zeros_like(token)
        longs += [(f"wp{g},{rate}", pages), (f"wo{g},{rate}", offsets)]
    sample = np.array([s.sample for s in seqs], dtype=bool)
    longs += [("state_slots", np.array([s.state_slot for s in seqs], dtype=np.int64)),
              ("logits_indices", (query_start[1:] - 1)[sample].astype(np.int64))]

    views = _transfer(longs, ints, device)
    seq_batch = SeqBatch(views["query_start"], views["seq_lens"], tuple(int(x) for x in query_start),
                         tuple(int(x) for x in ends))
    writes = {(g, rate): (views[f"wp{g},{rate}"], views[f"wo{g},{rate}"]) for g, rate, _ in layout.stream_kinds(block_size)}
    return StepMetadata(views["input_ids"], views["positions"], seq_batch, {g: views[f"table{g}"] for g in tables},
                        writes, views["state_slots"], views["logits_indices"], tuple(bool(s == 0) for s in starts),
                        tuple(s.state_slot for s in seqs))


def _transfer(longs: list[tuple[str, np.ndarray]], ints: list[tuple[str, np.ndarray]], device: torch.device
              ) -> dict[str, torch.Tensor]:
    """One host buffer (pinned on CUDA) holding every array, one copy to `device`, views by name."""
    arrays = [(name, a.astype(np.int64), torch.int64) for name, a in longs]
    arrays += [(name, a.astype(np.int32), torch.int32) for name, a in ints]  # after the int64s: 8-byte aligned
    total = sum(a.nbytes for _, a, _ in arrays)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = host.numpy()
    spans, offset = {}, 0
    for name, a, dtype in arrays:
        flat[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        spans[name] = (offset, a.nbytes, dtype, a.shape)
        offset += a.nbytes
    buf = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return {name: buf[start:start + size].view(dtype).view(shape) for name, (start, size, dtype, shape) in spans.items()}
