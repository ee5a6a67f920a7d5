"""Paged streams and the packed batch of a step: how attention ops read the KV pool in place.

A **stream** is one layer's cache of one kind (GQA keys or values, MLA latents or rope keys, index
keys, compressed entries): one entry of fixed shape per `rate` tokens of a sequence, stored in the
pages of its cache group's block pool (dayzero.cache.paged). `PagedStream` is what an op gets:
    data        [num_blocks, per_block, *entry]   a strided view of the pool's arena (stride(0) is the
                page size, not per_block * entry); float (model dtype) or float8_e4m3fn
    scales      float32 [num_blocks, per_block, *entry[:-1], ceil(entry[-1] / 128)] for an FP8 stream
                (one scale per FP8_GROUP values of the last dim, value = data * scale), else None
    block_table int32 [num_seqs, max_blocks] of the stream's cache group: row b is sequence b's pages
                in token order; -1 marks a page that is never read (reclaimed out of a sliding window,
                or past the sequence's end)
    block_size  tokens per page; rate: tokens per entry (1, or a compression ratio)
Entry e of sequence b (it pools tokens [e * rate, (e + 1) * rate)) lives in the page of its last token
t = e * rate + rate - 1 (`entry_token`), block_table[b, t // block_size], at offset (t % block_size) //
rate when a page holds several entries (rate divides block_size), at offset 0 when it holds one (rate a
multiple of it). The last token's page, not the first's: an entry is written when its window completes,
the same step that fills that page, so a full page (which prefix caching shares between requests) never
takes a later write; the first token's page would be shared while two requests' entries still differ.

A **SeqBatch** is the packed step: the tokens of all scheduled sequences in one [num_tokens] row,
sequence b's tokens at rows query_start[b] : query_start[b + 1]. After this step sequence b holds
seq_lens[b] tokens, so its queries sit at positions seq_lens[b] - query_len[b] ... seq_lens[b] - 1
(its first context_len[b] tokens were computed by earlier steps and are read from the cache).
Device tensors (int32) are what kernels read; the host lists are what the reference ops loop over
and what shape decisions use, so no op reads a device value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from dayzero.formats.fp8 import dequantize_activation_groups

FP8_GROUP = 128  # values per float32 scale along an FP8 stream's last dim


@dataclass(frozen=True)
class SeqBatch:
    query_start: torch.Tensor  # int32 [num_seqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_seqs], device: tokens of each sequence after this step
    query_start_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_host[-1]

    @cached_property
    def query_lens(self) -> tuple[int, ...]:
        q = self.query_start_host
        return tuple(q[i + 1] - q[i] for i in range(len(q) - 1))

    @cached_property
    def context_lens(self) -> tuple[int, ...]:
        """Tokens of each sequence computed before this step (read from the cache only)."""
        return tuple(s - t for s, t in zip(self.seq_lens_host, self.query_lens))

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @cached_property
    def is_decode(self) -> bool:
        """Every sequence computes exactly one token."""
        return all(t == 1 for t in self.query_lens)

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(first sequence, end sequence, query_len) of each run of consecutive sequences with equal
        query_len: their tokens are rows query_start[first] : query_start[end], a [end - first,
        query_len] block, for ops that work on [B, T] rows (recurrent state, compressors)."""
        out: list[tuple[int, int, int]] = []
        for b, t in enumerate(self.query_lens):
            if out and out[-1][2] == t:
                out[-1] = (out[-1][0], b + 1, t)
            else:
                out.append((b, b + 1, t))
        return tuple(out)

    @staticmethod
    def build(query_lens: list[int], seq_lens: list[int], device: torch.device | str) -> "SeqBatch":
        """A SeqBatch from host lengths (tests and the reference paths; the runner builds its own from
        one pinned transfer)."""
        if len(query_lens) != len(seq_lens) or any(t < 0 or t > s for t, s in zip(query_lens, seq_lens)):
            raise ValueError(f"SeqBatch: query_lens {query_lens} must pair with seq_lens {seq_lens}, each <= its seq_len")
        starts = [0]
        for t in query_lens:
            starts.append(starts[-1] + t)
        return SeqBatch(torch.tensor(starts, dtype=torch.int32, device=device),
                        torch.tensor(seq_lens, dtype=torch.int32, device=device), tuple(starts), tuple(seq_lens))


@dataclass(frozen=True)
class PagedStream:
    data: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    rate: int = 1
    scales: torch.Tensor | None = None
    dtype: torch.dtype | None = field(default=None)  # what reads return (an FP8 stream: the model dtype)

    @property
    def per_block(self) -> int:
        return self.data.shape[1]

    @property
    def entry_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[2:])

    @property
    def read_dtype(self) -> torch.dtype:
        return self.dtype or self.data.dtype

    def locations(self, seq: int, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of entries [n] (long, entry numbers) of sequence `seq`."""
        tokens = entry_token(entries, self.rate)
        pages = self.block_table[seq].long()[tokens // self.block_size]
        offsets = (tokens % self.block_size) // self.rate if self.per_block > 1 else torch.zeros_like(tokens)
        return pages, offsets

    def gather(self, seq: int, lo: int, hi: int) -> torch.Tensor:
        """Entries lo ... hi - 1 of sequence `seq` as a [hi - lo, *entry] tensor of read_dtype."""
        entries = torch.arange(lo, hi, device=self.data.device)
        return self.read(*self.locations(seq, entries))

    def gather_rows(self, seqs: list[int], lo: list[int], hi: list[int]) -> torch.Tensor:
        """Entries lo[i] ... hi[i] - 1 of sequence seqs[i] for every i, right-aligned in one
        [len(seqs), max(hi - lo), *entry] tensor of read_dtype (a shorter row's first columns are zeros):
        one gather for the rows, where `gather` takes one per row."""
        counts = [h - l for l, h in zip(lo, hi)]
        width, device = max(counts, default=0), self.data.device
        if width == 0:
            return torch.zeros((len(seqs), 0, *self.entry_shape), dtype=self.read_dtype, device=device)
        seq, first, n = torch.tensor([seqs, lo, counts], dtype=torch.long).to(device, non_blocking=True)
        shift = torch.arange(width, device=device)[None, :] - (width - n)[:, None]  # < 0: the row's padding
        valid = shift >= 0
        tokens = entry_token(torch.where(valid, first[:, None] + shift, 0), self.rate)
        pages = self.block_table[seq[:, None], tokens // self.block_size].long()
        offsets = (tokens % self.block_size) // self.rate if self.per_block > 1 else torch.zeros_like(tokens)
        values = self.read(pages, offsets)  # padding read entry 0 (or any page): zeroed, so always finite
        return values.masked_fill(~valid.view(*valid.shape, *(1,) * len(self.entry_shape)), 0)

    def gather_at(self, seq: int, entries: torch.Tensor) -> torch.Tensor:
        """The entries at numbers entries [...] (long, >= 0) of sequence `seq`: [..., *entry]."""
        pages, offsets = self.locations(seq, entries.reshape(-1))
        return self.read(pages, offsets).view(*entries.shape, *self.entry_shape)

    def read(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        values = self.data[pages, offsets]
        if self.scales is None:
            return values
        return dequantize_activation_groups(values, self.scales[pages, offsets], FP8_GROUP, self.read_dtype)


def entry_token(entries, rate: int):
    """The token whose page holds entry `entries` of a stream of `rate` (module docstring): its last."""
    return entries * rate + (rate - 1)


def token_sequences(seqs: SeqBatch) -> torch.Tensor:
    """int32 [num_tokens] on the step's device: the sequence of each packed token (from query_start,
    no host sync)."""
    rows = torch.arange(seqs.num_tokens, device=seqs.query_start.device, dtype=torch.int32)
    return torch.searchsorted(seqs.query_start[1:], rows, right=True).to(torch.int32)


def query_chunks(num_queries: int, num_keys: int, heads: int, budget: int = 1 << 25) -> int:
    """Queries per chunk of a reference attention so that its float32 scores [heads, chunk, keys]
    stay under `budget` elements (128 MiB): memory O(tokens x chunk), not O(tokens^2)."""
    return max(1, min(num_queries, budget // max(1, num_keys * heads)))
