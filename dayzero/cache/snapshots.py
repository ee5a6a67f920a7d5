"""Which recurrent-state snapshots exist: block hash -> snapshot slot, least recently used first.

Bookkeeping only (plain Python on the CPU); the runner owns the state tensors the slots index.

A model with per-request state (KDA conv and recurrent state) cannot resume a cached prefix from
its KV blocks alone: it needs its state as it was right after the prefix. The runner saves the
state when a request's computed tokens reach a block boundary, keyed by the hash of the prefix up to
there (the hash of the block that ends at the boundary), and a later request whose prompt starts
with that prefix resumes from it. Invariants
- A hash maps to at most one slot, a slot to at most one hash; `capacity` slots in all.
- `insert` of a new hash when full evicts the least recently inserted or looked-up hash.
"""

from __future__ import annotations

from collections import OrderedDict

from dayzero.cache.block_pool import BlockHash


class SnapshotCache:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"snapshot capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.saved = 0  # snapshots written
        self.restored = 0  # snapshots a request resumed from

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding the state after this prefix, or None; counts as a use."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
            self.restored += 1
        return slot

    def insert(self, block_hash: BlockHash) -> int | None:
        """A slot to write the state after this prefix into (None with capacity 0)."""
        if self.capacity == 0:
            return None
        slot = self._slots.pop(block_hash, None)
        if slot is None:
            slot = self._free.pop() if self._free else self._slots.popitem(last=False)[1]
        self._slots[block_hash] = slot
        self.saved += 1
        return slot

    def discard(self, block_hash: BlockHash) -> None:
        """Forget the snapshot after this prefix (its slot becomes free), if there is one."""
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
