"""Per-request block tables over one BlockPool, with prefix reuse of full blocks.

Bookkeeping only (plain Python on the CPU); the runner turns block tables into device tensors.

Invariants
- A request's block table holds ceil(tokens held / block_size) block ids: block i stores the KV
  entries of tokens [i * block_size, (i + 1) * block_size). Blocks are taken only by
  `match_prefix` (shared, already cached) and `allocate_slots` (fresh), and all of them go back
  to the pool in `free`, tail first.
- Only full blocks of computed tokens are hashed and registered (`cache_full_blocks`); a block's
  hash chains its tokens to the block before it (`BlockHash.of`), so a match is always a prefix.
- The manager never changes a Request: the scheduler owns `num_computed_tokens` and status.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dayzero.cache.block_pool import BlockHash, BlockPool, NoFreeBlocksError, chain_hashes

if TYPE_CHECKING:
    from dayzero.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 tokens, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}  # hashes of the request's leading full blocks
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already registered in the pool

    # -- state ------------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks held by requests."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- per request ------------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """Take the cached blocks of the longest hashed prefix of the request's tokens and return how
        many tokens they hold (a multiple of block_size). At least one token is always left to
        compute, since a step must produce logits for the last one. Call on a request holding no
        blocks; the caller sets req.num_computed_tokens from the result (or calls `free` to undo)."""
        if self.block_tables.get(req.request_id):
            raise RuntimeError(f"request {req.request_id!r} already holds blocks; match_prefix is for admission")
        table = self.block_tables.setdefault(req.request_id, [])
        if not self.enable_prefix_caching:
            return 0
        matchable = (req.num_tokens - 1) // self.block_size * self.block_size
        hashes = chain_hashes(req.token_ids(0, matchable), self.block_size)
        found = self.pool.match_prefix(hashes)
        table.extend(found)
        self._block_hashes[req.request_id] = hashes[:len(found)]
        self._num_cached_blocks[req.request_id] = len(found)
        return len(found) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow the block table so that num_computed_tokens + num_new_tokens tokens fit. All or
        nothing: False (and no change) when the pool cannot supply the blocks."""
        table = self.block_tables.setdefault(req.request_id, [])
        need = self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(table)
        if need <= 0:
            return True
        try:
            table.extend(self.pool.allocate(need))
        except NoFreeBlocksError:
            return False
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Hash and register every block that computing up to req.num_computed_tokens has filled."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        table = self.block_tables[rid]
        hashes = self._block_hashes.setdefault(rid, [])
        done = self._num_cached_blocks.get(rid, 0)
        num_full = req.num_computed_tokens // self.block_size
        bs = self.block_size
        for i in range(done, num_full):
            if i == len(hashes):
                hashes.append(BlockHash.of(hashes[-1] if hashes else None, req.token_ids(i * bs, (i + 1) * bs)))
            self.pool.cache_block(table[i], hashes[i])
        self._num_cached_blocks[rid] = max(done, num_full)

    def free(self, req: Request) -> None:
        """Give all the request's blocks back, tail first (a prefix's last blocks are evicted first)."""
        table = self.block_tables.pop(req.request_id, [])
        self._block_hashes.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        self.pool.release(reversed(table))
