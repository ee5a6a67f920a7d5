"""KV cache bookkeeping: the block pool and its hashed-block prefix cache."""

from dayzero.cache.block_pool import BlockHash, BlockPool, NoFreeBlocksError, chain_hashes
from dayzero.cache.kv_manager import KVCacheManager

__all__ = ["BlockHash", "BlockPool", "KVCacheManager", "NoFreeBlocksError", "chain_hashes"]
