"""The block pool: fixed-size KV blocks, reference counts, and the hashed-block prefix cache.

Bookkeeping only (plain Python on the CPU); the runner owns the device tensors that block ids index.

Invariants
- Every block id in [0, num_blocks) is in exactly one of two states: in use (ref_count > 0, held
  by the block tables of that many requests) or free (ref_count == 0, in the free queue).
- A full block may carry a content hash (`BlockHash`: the hash of its tokens chained to the hash
  of the block before it, so equal hashes mean equal prefixes). A hashed block stays findable after
  its last user releases it, until it is handed out again: free blocks are evicted in LRU order
  (least recently released first), and the hash goes with the eviction.
- `allocate` never hands out a block that is in use; a prefix hit revives a free hashed block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate when the pool cannot supply the blocks; the scheduler preempts and retries."""


@dataclass(frozen=True)
class BlockHash:
    """Content hash of one full block: its tokens and everything before them (and an extra key:
    for example an image's hash, or the LoRA adapter)."""

    value: int

    @staticmethod
    def of(parent: "BlockHash | None", tokens: Sequence[int], extra: Hashable = None) -> "BlockHash":
        return BlockHash(hash((None if parent is None else parent.value, tuple(tokens), extra)))


def chain_hashes(token_ids: Sequence[int], block_size: int, extra: Hashable = None) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = BlockHash.of(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self._cached: dict[Hashable, int] = {}
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found

    # -- state ------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # -- allocation -------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks for exclusive use (ref_count 1), least recently released first; their hashes,
        if any, are evicted. All or nothing."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict_hash(block)
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds becomes free (most recently
        released last, so it is evicted last). Pass a request's blocks tail first, so that a
        prefix's last blocks are evicted before its first."""
        for block in blocks:
            if self.ref_count[block] <= 0:
                raise RuntimeError(f"block {block} released more often than it was taken")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None

    # -- prefix cache -----------------------------------------------------------------------------
    def cache_block(self, block: int, block_hash: Hashable) -> None:
        """Make a full, in-use block findable by its content hash (a first writer wins on equal hashes).
        Any hashable key works: the KV manager keys a cache group's blocks by (group, hash)."""
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} is not in use; only a held block can be cached")
        if self.block_hash[block] is not None or block_hash in self._cached:
            return
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes`, each taken (ref_count + 1)."""
        found: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        self.prefix_queries += len(hashes)
        self.prefix_hits += len(found)
        return [self.take(block) for block in found]

    def lookup(self, key: Hashable) -> int | None:
        """The block cached under `key`, or None; takes nothing."""
        return self._cached.get(key)

    def take(self, block: int) -> int:
        """One more reference to a block (a cached free block is revived); returns it."""
        if self.ref_count[block] == 0:
            del self._free[block]
        self.ref_count[block] += 1
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every hash (/flush_cache); refused (False) while any block is in use."""
        if any(self.ref_count):
            return False
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def _evict_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self._cached[h]
            self.block_hash[block] = None
