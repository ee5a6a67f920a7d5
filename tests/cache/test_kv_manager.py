"""KVCacheManager: block tables sized to the tokens held, all-or-nothing growth, prefix matches that
always leave a token to compute, incremental registration of full blocks, tail-first release."""

from dayzero.cache import BlockPool, KVCacheManager
from dayzero.engine.request import Request


def _assert_all_free(kv: KVCacheManager):
    assert kv.pool.num_free == kv.pool.num_blocks and not kv.block_tables


def test_allocate_slots_grows_by_blocks_and_is_all_or_nothing():
    kv = KVCacheManager(BlockPool(4), block_size=4)
    a = Request("a", list(range(10)))
    assert kv.allocate_slots(a, 10) and len(kv.block_table("a")) == 3
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) and len(kv.block_table("a")) == 3  # fits in block 2
    assert kv.allocate_slots(a, 6) and len(kv.block_table("a")) == 4
    b = Request("b", [1, 2, 3])
    assert not kv.allocate_slots(b, 3)
    assert kv.block_table("b") == [] and kv.num_free_blocks == 0 and kv.usage == 1.0
    kv.free(a)
    kv.free(b)
    _assert_all_free(kv)


def test_prefix_match_reuses_full_computed_blocks_and_leaves_one_token():
    kv = KVCacheManager(BlockPool(8), block_size=4)
    a = Request("a", list(range(12)))
    assert kv.match_prefix(a) == 0
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 6
    kv.cache_full_blocks(a)  # one full block computed so far
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    blocks_a = list(kv.block_table("a"))

    same = Request("same", list(range(12)))  # whole prompt cached: the last block is recomputed
    assert kv.match_prefix(same) == 8 and kv.block_table("same") == blocks_a[:2]
    longer = Request("longer", list(range(12)) + [50])
    assert kv.match_prefix(longer) == 12 and kv.block_table("longer") == blocks_a
    other = Request("other", [99] + list(range(1, 12)))
    assert kv.match_prefix(other) == 0
    for r in (a, same, longer, other):
        kv.free(r)
    _assert_all_free(kv)
    # Released hashed blocks stay findable.
    again = Request("again", list(range(9)))
    assert kv.match_prefix(again) == 8
    kv.free(again)
    _assert_all_free(kv)


def test_prefix_caching_off_matches_nothing():
    kv = KVCacheManager(BlockPool(4), block_size=2, enable_prefix_caching=False)
    a = Request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    kv.free(a)
    assert kv.match_prefix(Request("b", [1, 2, 3, 4, 5])) == 0
    kv.free(Request("b", []))
    _assert_all_free(kv)


def _computed(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.allocate_slots(req, n - req.num_computed_tokens)
    req.num_computed_tokens = n
    kv.cache_full_blocks(req)


def test_window_group_gives_back_blocks_out_of_the_window():
    full, window = BlockPool(16), BlockPool(6)
    kv = KVCacheManager([full, window], block_size=4, windows=(None, 6))  # reads the last 5 tokens
    a = Request("a", list(range(30)))
    kv.match_prefix(a)
    _computed(kv, a, 13)  # the next token (13) reads tokens 8..12: blocks 2 and 3
    assert kv.block_table("a", 1)[:2] == [None, None] and None not in kv.block_table("a", 1)[2:]
    assert len(kv.block_table("a", 0)) == 4 and window.num_free == 6 - 2
    _computed(kv, a, 30)
    assert kv.held_blocks("a", 1) == [b for b in kv.block_table("a", 1) if b is not None]
    assert len(kv.held_blocks("a", 1)) == 2 and len(kv.held_blocks("a", 0)) == 8
    kv.free(a)
    assert full.num_free == 16 and window.num_free == 6 and not kv.block_tables


def test_group_allocation_is_all_or_nothing_across_pools():
    kv = KVCacheManager([BlockPool(8), BlockPool(1)], block_size=4, windows=(None, 4))
    a = Request("a", list(range(8)))
    assert not kv.allocate_slots(a, 8)  # the window pool has 1 block, 2 are needed during the step
    assert kv.block_table("a", 0) == [] and kv.pools[0].num_free == 8
    kv.free(a)


def test_a_prefix_is_reused_only_where_every_group_and_the_state_can_resume():
    from dayzero.cache.snapshots import SnapshotCache

    snaps = SnapshotCache(4)
    kv = KVCacheManager([BlockPool(16), BlockPool(16)], block_size=4, windows=(None, 6), snapshots=snaps)
    a = Request("a", list(range(20)))
    kv.match_prefix(a)
    _computed(kv, a, 20)
    hashes = kv.block_hashes(a, 5)
    kv.free(a)
    b = Request("b", list(range(20)) + [99])
    assert kv.match_prefix(b) == 0  # no state snapshot anywhere
    kv.free(b)
    snaps.insert(hashes[2])  # the state after 12 tokens
    assert kv.match_prefix(b) == 12
    # full group: blocks 0..2; window group: only the blocks of tokens 7..11 (blocks 1 and 2)
    assert len(kv.held_blocks("b", 0)) == 3 and kv.block_table("b", 1)[0] is None and len(kv.held_blocks("b", 1)) == 2
    kv.free(b)
    kv.pools[1].allocate(16)  # evicts every cached window block
    assert kv.match_prefix(b) == 0
    kv.free(b)


def test_snapshot_cache_is_lru_and_bounded():
    from dayzero.cache.block_pool import BlockHash
    from dayzero.cache.snapshots import SnapshotCache

    snaps = SnapshotCache(2)
    s1, s2 = snaps.insert(BlockHash(1)), snaps.insert(BlockHash(2))
    assert {s1, s2} == {0, 1}
    assert snaps.lookup(BlockHash(1)) == s1  # 2 is now the least recently used
    assert snaps.insert(BlockHash(3)) == s2 and BlockHash(2) not in snaps and len(snaps) == 2
    assert snaps.insert(BlockHash(1)) == s1 and snaps.saved == 4 and snaps.restored == 1
    assert SnapshotCache(0).insert(BlockHash(5)) is None
