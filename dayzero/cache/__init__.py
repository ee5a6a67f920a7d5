"""KV cache bookkeeping: the block pool and its hashed-block prefix cache."""

from dayzero.cache.block_pool import BlockHash, BlockPool, NoFreeBlocksError, chain_hashes

__all__ = ["BlockHash", "BlockPool", "NoFreeBlocksError", "chain_hashes"]
