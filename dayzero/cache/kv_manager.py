"""Per-request block tables over one BlockPool, one table per cache group, with prefix reuse.

Bookkeeping only (plain Python on the CPU); the runner turns block tables into device tensors.

Cache groups. Layers whose caches have the same geometry share a group (`windows[g]`): None for
full attention (every entry is kept), W for a sliding window of W tokens (only the last W - 1
entries before the next token are read, so older blocks go back to the pool: `reclaim`). Each group
has its own pool (`pools[g]`; their pages differ in size); block i of a group's table holds that
group's entries of tokens [i * block_size, (i + 1) * block_size) in every layer of the group. The
first group's pool (full attention when the model has it) bounds the context and is `pool`; a window
group's pool is sized by the engine so that it never runs out first (`window_pool_blocks`).

Invariants
- A request's table in group g has one entry per block up to ceil(tokens held / block_size); a
  sliding-window table holds None for the blocks reclaimed from it. Blocks are taken only by
  `match_prefix` (shared, already cached) and `allocate_slots` (fresh); `reclaim` and `free` give
  them back (free tail first).
- Only full blocks of computed tokens are hashed and registered (`cache_full_blocks`), per group; a
  block's hash chains its tokens to the block before it (`BlockHash.of`), so a match is a prefix. The
  hash of a block that holds image placeholder tokens also covers the images' content hashes
  (`Request.block_extra_keys`, vLLM's "extra keys"): equal placeholders of different images never match.
- A prefix is reused only where every group can resume from it: full groups need all its blocks,
  window groups the blocks of its last W - 1 tokens, and a model with recurrent state a snapshot of
  that state at the prefix's end (`snapshots`, filled by the runner).
- The manager never changes a Request: the scheduler owns `num_computed_tokens` and status.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from dayzero.cache.block_pool import BlockHash, BlockPool
from dayzero.cache.snapshots import SnapshotCache

if TYPE_CHECKING:
    from dayzero.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool | Sequence[BlockPool], block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,), snapshots: SnapshotCache | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 tokens, got {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"cache groups need windows of None (full) or >= 1 tokens, got {list(windows)}")
        self.pools = [pool] if isinstance(pool, BlockPool) else list(pool)
        if len(self.pools) != len(windows):
            raise ValueError(f"{len(windows)} cache groups need as many pools, got {len(self.pools)}")
        self.pool = self.pools[0]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.snapshots = snapshots
        self.block_tables: dict[str, list[list[int | None]]] = {}  # request -> per group
        self._block_hashes: dict[str, list[BlockHash]] = {}  # hashes of the request's leading full blocks
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already registered in the pool

    # -- state ------------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks held by requests."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_table(self, request_id: str, group: int = 0) -> list[int | None]:
        tables = self.block_tables.get(request_id)
        return tables[group] if tables else []

    def held_blocks(self, request_id: str, group: int = 0) -> list[int]:
        """The blocks the request holds in one group's pool."""
        tables = self.block_tables.get(request_id)
        return [b for b in tables[group] if b is not None] if tables else []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash and saved state; refused (False) while any block is in use."""
        if any(any(p.ref_count) for p in self.pools):
            return False
        for p in self.pools:
            p.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()
        return True

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_for(self, num_tokens: int) -> int:
        """Blocks of the first pool a request of num_tokens holds at most."""
        return self.num_blocks_for(num_tokens) if self.windows[0] is None else self.pool.num_blocks

    def block_hashes(self, req: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first num_blocks full blocks (its known tokens must cover them)."""
        hashes = self._block_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(BlockHash.of(hashes[-1] if hashes else None, req.token_ids(i * bs, (i + 1) * bs),
                                       req.block_extra_keys(i * bs, (i + 1) * bs)))
        return hashes[:num_blocks]

    def _window_start(self, group: int, num_tokens: int) -> int:
        """First block of `group` that a query at position num_tokens still reads."""
        w = self.windows[group]
        return 0 if w is None else max(num_tokens - (w - 1), 0) // self.block_size

    # -- per request ------------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """Take the cached blocks of the longest reusable prefix of the request's tokens and return how
        many tokens they hold (a multiple of block_size). At least one token is always left to
        compute, since a step must produce logits for the last one. Call on a request holding no
        blocks; the caller sets req.num_computed_tokens from the result (or calls `free` to undo)."""
        if any(self.held_blocks(req.request_id, g) for g in range(self.num_groups)):
            raise RuntimeError(f"request {req.request_id!r} already holds blocks; match_prefix is for admission")
        self.block_tables[req.request_id] = [[] for _ in self.windows]
        if not self.enable_prefix_caching:
            return 0
        hashes = self.block_hashes(req, (req.num_tokens - 1) // self.block_size)
        found = len(hashes)
        for g, w in enumerate(self.windows):
            if w is None:
                found = next((i for i, h in enumerate(hashes[:found]) if self.pools[g].lookup(h) is None), found)
        while found and not self._resumable(hashes, found):
            found -= 1
        self.pool.prefix_queries += len(hashes)
        self.pool.prefix_hits += found
        tables = self.block_tables[req.request_id]
        for g, table in enumerate(tables):
            start = self._window_start(g, found * self.block_size)
            table.extend([None] * start)
            table.extend(self.pools[g].take(self.pools[g].lookup(h)) for h in hashes[start:found])
        self._num_cached_blocks[req.request_id] = found
        return found * self.block_size

    def _resumable(self, hashes: list[BlockHash], n: int) -> bool:
        """Can a request resume after the first n blocks (full groups are checked by the caller)?"""
        for g, w in enumerate(self.windows):
            if w is not None and any(self.pools[g].lookup(h) is None
                                     for h in hashes[self._window_start(g, n * self.block_size):n]):
                return False
        return self.snapshots is None or hashes[n - 1] in self.snapshots

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow every group's block table so that num_computed_tokens + num_new_tokens tokens fit. All
        or nothing: False (and no change) when the pool cannot supply the blocks."""
        tables = self.block_tables.setdefault(req.request_id, [[] for _ in self.windows])
        total = self.num_blocks_for(req.num_computed_tokens + num_new_tokens)
        need = [max(total - len(t), 0) for t in tables]
        if any(n > pool.num_free for n, pool in zip(need, self.pools)):
            return False
        for table, n, pool in zip(tables, need, self.pools):
            if n:
                table.extend(pool.allocate(n))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Hash and register every block that computing up to req.num_computed_tokens has filled,
        then give back the window groups' blocks no later token will read."""
        rid = req.request_id
        tables = self.block_tables[rid]
        if self.enable_prefix_caching:
            done = self._num_cached_blocks.get(rid, 0)
            num_full = req.num_computed_tokens // self.block_size
            hashes = self.block_hashes(req, num_full)
            for g, table in enumerate(tables):
                for i in range(done, num_full):
                    if table[i] is not None:
                        self.pools[g].cache_block(table[i], hashes[i])
            self._num_cached_blocks[rid] = max(done, num_full)
        self.reclaim(req)

    def reclaim(self, req: Request) -> None:
        """Sliding-window groups: blocks that end before the window of the next token go back."""
        for g, table in enumerate(self.block_tables[req.request_id]):
            if self.windows[g] is None:
                continue
            for i in range(min(self._window_start(g, req.num_computed_tokens), len(table))):
                if table[i] is not None:
                    self.pools[g].release([table[i]])
                    table[i] = None

    def free(self, req: Request) -> None:
        """Give all the request's blocks back, tail first (a prefix's last blocks are evicted first)."""
        tables = self.block_tables.pop(req.request_id, [])
        self._block_hashes.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        for table, pool in zip(tables, self.pools):
            pool.release(b for b in reversed(table) if b is not None)
