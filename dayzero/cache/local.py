"""A paged cache owned by one caller: B sequences that advance together, for the [B, T] model API
(tests, `dayzero verify`, a full forward). The same storage and step metadata as the engine's
(dayzero.cache.paged), without sharing, reclaim or a scheduler: every sequence owns its pages, and
the pool doubles when the sequences outgrow it."""

from __future__ import annotations

import torch

from dayzero.cache.paged import CacheLayout, PagedKVStorage, PagedStepCache, checked_layout
from dayzero.cache.step import SeqStep, build_step

BLOCK_SIZE = 16


def _block_size(layout: CacheLayout) -> int:
    """16 tokens, unless an entry rate needs otherwise (a rate must divide or be a multiple of it)."""
    rates = {s.rate for s in layout.streams}
    if all((r <= BLOCK_SIZE and BLOCK_SIZE % r == 0) or r % BLOCK_SIZE == 0 for r in rates):
        return BLOCK_SIZE
    return max(rates)


def model_layout(model: torch.nn.Module) -> CacheLayout:
    """The model's cache layout (its spec's, checked against what it writes), once per model object."""
    layout = getattr(model, "_dayzero_layout", None)
    if layout is None:
        layout = checked_layout(model)
        model._dayzero_layout = layout
    return layout


class LocalCache:
    def __init__(self, model: torch.nn.Module, batch: int, kv_cache_dtype: str = "auto"):
        self.model, self.batch, self.length = model, batch, 0
        self.layout = model_layout(model).with_kv_cache_dtype(kv_cache_dtype)
        self.block_size = _block_size(self.layout)
        groups = len(self.layout.windows)
        self.tables: list[list[list[int]]] = [[[] for _ in range(groups)] for _ in range(batch)]
        self.used = [0] * groups
        self.storage = PagedKVStorage(self.layout, [batch] * groups, self.block_size, batch, 0, model.device_)

    def _reserve(self, num_tokens: int) -> None:
        """Pages for num_tokens tokens per sequence, growing the pool when needed."""
        need = -(-num_tokens // self.block_size)
        for g in range(len(self.used)):
            for table in self.tables:
                while len(table[g]) < need:
                    table[g].append(self.used[g])
                    self.used[g] += 1
        if any(u > n for u, n in zip(self.used, self.storage.num_blocks)):
            self._grow([max(2 * n, u) for u, n in zip(self.used, self.storage.num_blocks)])

    def _grow(self, num_blocks: list[int]) -> None:
        old = self.storage
        new = PagedKVStorage(self.layout, num_blocks, self.block_size, self.batch, 0, self.model.device_)
        for a, b in zip(old.arenas, new.arenas):
            b[:a.shape[0]] = a
        for key, t in old.states.items():
            new.states[key].copy_(t)
        self.storage = new

    def step(self, num_new: int) -> PagedStepCache:
        """The cache of the next forward: every sequence computes num_new tokens after `length`;
        logits for every row (logits_indices None)."""
        self._reserve(self.length + num_new)
        seqs = [SeqStep(self.length, num_new, self.tables[b], b) for b in range(self.batch)]
        meta = build_step(seqs, self.layout, self.block_size, self.model.device_)
        cache = PagedStepCache(self.storage, meta, self.model.spec.num_layers)
        cache.logits_indices = None
        self.length += num_new
        return cache
