import random

import pytest

from dayzero.cache import BlockHash, BlockPool, NoFreeBlocksError, chain_hashes


def _check_invariants(pool: BlockPool):
    free = set(pool._free)
    for b in range(pool.num_blocks):
        assert (pool.ref_count[b] == 0) == (b in free), b
        assert pool.ref_count[b] >= 0
    for h, b in pool._cached.items():
        assert pool.block_hash[b] == h


def test_allocate_is_all_or_nothing_and_release_frees():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(NoFreeBlocksError, match="asked for 2 KV blocks, 1 free of 4"):
        pool.allocate(2)
    assert pool.num_free == 1  # nothing taken by the failed call
    pool.release(a)
    assert pool.num_free == 4 and pool.usage == 0.0
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a[0]])
    _check_invariants(pool)


def test_hash_chain_depends_on_the_whole_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7], block_size=3)
    b = chain_hashes([1, 2, 3, 4, 5, 6, 8, 9], block_size=3)
    c = chain_hashes([0, 2, 3, 4, 5, 6], block_size=3)
    assert len(a) == 2 and len(b) == 2  # partial blocks have no hash
    assert a == b[:2]
    assert c[0] != a[0] and c[1] != a[1]  # same tokens in block 1, different history
    assert chain_hashes([1, 2, 3], 3, extra="image-1") != chain_hashes([1, 2, 3], 3)


def test_prefix_match_revives_released_blocks_and_counts_hits():
    pool = BlockPool(6)
    hashes = chain_hashes(list(range(12)), block_size=4)  # 3 full blocks
    first = pool.allocate(3)
    for block, h in zip(first, hashes):
        pool.cache_block(block, h)
    pool.release(reversed(first))
    assert pool.num_free == 6
    hit = pool.match_prefix(chain_hashes(list(range(8)) + [99, 98, 97, 96], block_size=4))
    assert hit == first[:2]
    assert pool.ref_count[first[0]] == 1 and pool.num_free == 4
    assert pool.prefix_hits == 2 and pool.prefix_queries == 3
    shared = pool.match_prefix(hashes[:1])  # a second request shares block 0
    assert shared == first[:1] and pool.ref_count[first[0]] == 2
    _check_invariants(pool)


def test_eviction_is_lru_and_drops_the_hash():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [BlockHash(i) for i in range(3)]
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool.release([blocks[2]])  # released first -> evicted first
    pool.release([blocks[0]])
    pool.release([blocks[1]])
    (taken,) = pool.allocate(1)
    assert taken == blocks[2]
    assert pool.match_prefix([hashes[2]]) == []  # its hash went with it
    assert pool.match_prefix([hashes[0]]) == [blocks[0]]
    _check_invariants(pool)


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, BlockHash(7))
    assert pool.reset_prefix_cache() is False
    pool.release([b])
    assert pool.reset_prefix_cache() is True
    assert pool.match_prefix([BlockHash(7)]) == []


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    pool = BlockPool(16)
    held: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 5)
            try:
                blocks = pool.allocate(n)
            except NoFreeBlocksError:
                assert pool.num_free < n
                continue
            for b in blocks:
                if rng.random() < 0.5:
                    pool.cache_block(b, BlockHash(rng.randint(0, 30)))
            held.append(blocks)
        elif op < 0.7 and held:
            pool.release(reversed(held.pop(rng.randrange(len(held)))))
        else:
            held.append(pool.match_prefix([BlockHash(rng.randint(0, 30)) for _ in range(rng.randint(1, 3))]))
        if step % 50 == 0:
            _check_invariants(pool)
    for blocks in held:
        pool.release(blocks)
    assert pool.num_free == 16
    _check_invariants(pool)
