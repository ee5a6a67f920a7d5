"""Random paged streams for attention op tests: contiguous per-sequence entries scattered into
shuffled pages of a pool whose page stride leaves room for other streams (as the arena does), the
unused pages and page slots filled with NaN so that reading anything a sequence does not own shows."""

from __future__ import annotations

import torch

from dayzero.formats.fp8 import quantize_activation_groups
from dayzero.ops.paged import FP8_GROUP, PagedStream, SeqBatch


def paged_stream(entries: list[torch.Tensor], block_size: int, *, generator: torch.Generator, rate: int = 1,
                 fp8: bool = False, window: int | None = None, seq_lens: list[int] | None = None,
                 spare_pages: int = 3) -> PagedStream:
    """entries[b]: sequence b's entries [n_b, *entry] (n_b = seq_len // rate). Pages are assigned in a
    random order; with `window` W (tokens) pages wholly before every query's window are left out of
    the table (-1), as a sliding-window group reclaims them (seq_lens needed then: the queries' last
    positions are seq_len - 1, the first query's window decides)."""
    shape, dtype, device = tuple(entries[0].shape[1:]), entries[0].dtype, entries[0].device
    per_block = max(1, block_size // rate)
    tokens = [e.shape[0] * rate for e in entries]
    pages_per_seq = [-(-t // block_size) for t in tokens]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()
    store_dtype = torch.float8_e4m3fn if fp8 else dtype
    # a wider page (2 extra entries) so that stride(0) != per_block * entry, as in the arena
    raw = torch.full((num_pages, per_block + 2, *shape), float("nan"), dtype=torch.float32, device=device)
    data = raw.to(store_dtype)[:, :per_block]
    scales = None
    if fp8:
        scale_shape = (*shape[:-1], -(-shape[-1] // FP8_GROUP))
        scales = torch.full((num_pages, per_block + 2, *scale_shape), float("nan"), device=device)[:, :per_block]
    width = max(pages_per_seq, default=0) + 1
    table = torch.full((len(entries), width), -1, dtype=torch.int32)
    nxt = 0
    for b, (e, n_pages) in enumerate(zip(entries, pages_per_seq)):
        for p in range(n_pages):
            table[b, p] = order[nxt]
            nxt += 1
        idx = torch.arange(e.shape[0])
        tok = idx * rate
        page = table[b].long()[tok // block_size]
        off = (tok % block_size) // rate if per_block > 1 else torch.zeros_like(tok)
        if fp8:
            q, sc = quantize_activation_groups(e.reshape(-1, *shape), FP8_GROUP)
            data[page.to(device), off.to(device)] = q
            scales[page.to(device), off.to(device)] = sc
        else:
            data[page.to(device), off.to(device)] = e
        if window is not None:
            assert seq_lens is not None
            first_token = max(0, seq_lens[b] - 1 - (window - 1)) if seq_lens[b] else 0
            table[b, :first_token // block_size] = -1
    return PagedStream(data, table.to(device), block_size, rate, scales, dtype if fp8 else None)


def random_batch(rng, num_seqs: int, max_len: int, kinds=("decode", "chunk", "fresh")) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) of a random packed step: each sequence a decode, a chunk on a cached
    prefix, or a fresh prefill of up to max_len tokens."""
    query_lens, seq_lens = [], []
    for _ in range(num_seqs):
        kind = rng.choice(kinds)
        total = rng.randint(1, max_len)
        query_lens.append(1 if kind == "decode" else total if kind == "fresh" else rng.randint(1, total))
        seq_lens.append(total)
    return query_lens, seq_lens


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """x as an FP8 stream stores it (what attention reads back)."""
    from dayzero.formats.fp8 import dequantize_activation_groups
    q, sc = quantize_activation_groups(x, FP8_GROUP)
    return dequantize_activation_groups(q, sc, FP8_GROUP, x.dtype)


def seq_batch(query_lens: list[int], seq_lens: list[int], device="cpu") -> SeqBatch:
    return SeqBatch.build(query_lens, seq_lens, device)
