"""The KV cache: the block pool and its hashed-block prefix cache, block tables per cache group
(kv_manager), recurrent-state snapshots, and the paged device storage models write through
(paged, imported on its own: it is device code)."""

from dayzero.cache.block_pool import BlockHash, BlockPool, NoFreeBlocksError, chain_hashes
from dayzero.cache.kv_manager import KVCacheManager

__all__ = ["BlockHash", "BlockPool", "KVCacheManager", "NoFreeBlocksError", "chain_hashes"]
