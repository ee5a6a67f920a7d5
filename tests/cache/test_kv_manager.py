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
