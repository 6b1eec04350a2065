from engine_core.kv_cache.manager import KVCacheManager

from .helpers import make_request


def compute(kv, request, num_tokens):
    """What the scheduler does after a step computed the request's tokens."""
    request.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(request)


def test_allocation_rounds_up_to_blocks_and_extends_held_ones():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    request = make_request("a", list(range(10)))
    assert [b.block_id for b in kv.allocate_slots(request, 10)] == [0, 1, 2]
    compute(kv, request, 10)
    assert kv.allocate_slots(request, 2) == []  # 12 tokens still fit in 3 blocks
    assert [b.block_id for b in kv.allocate_slots(request, 3)] == [3]  # 13 tokens need a 4th
    assert kv.block_ids("a") == [0, 1, 2, 3]


def test_a_refused_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert kv.allocate_slots(request, 12) is None
    assert kv.pool.num_free_blocks == 2 and kv.block_ids("a") == []


def test_only_computed_full_blocks_enter_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(10)))
    kv.allocate_slots(first, 10)
    second = make_request("b", list(range(10)))
    assert kv.get_computed_blocks(second) == ([], 0)  # allocated, not computed: no hit
    compute(kv, first, 6)
    hits, num_tokens = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [0] and num_tokens == 4
    compute(kv, first, 10)
    hits, num_tokens = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [0, 1] and num_tokens == 8


def test_a_hit_always_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(8)))
    kv.allocate_slots(first, 8)
    compute(kv, first, 8)
    same = make_request("b", list(range(8)))  # fully cached, but its last token's logits are needed
    hits, num_tokens = kv.get_computed_blocks(same)
    assert [b.block_id for b in hits] == [0] and num_tokens == 4


def test_hits_are_shared_and_freed_tails_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    first = make_request("a", list(range(9)))
    kv.allocate_slots(first, 9)
    compute(kv, first, 9)
    second = make_request("b", [*range(8), 50, 51, 52])
    hits, num_tokens = kv.get_computed_blocks(second)
    assert [b.block_id for b in kv.allocate_slots(second, 11 - num_tokens, hits)] == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    kv.free(first)
    assert kv.pool.free_block_ids() == [4, 5, 2]
    kv.free(second)
    assert kv.pool.free_block_ids() == [4, 5, 2, 3, 1, 0]


def test_a_hit_on_a_free_cached_block_is_not_counted_as_allocatable():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    first = make_request("a", list(range(8)))
    kv.allocate_slots(first, 8)
    compute(kv, first, 8)
    kv.free(first)  # blocks 0 and 1 are free but cached
    second = make_request("b", list(range(8)) + list(range(100, 108)))
    hits, num_tokens = kv.get_computed_blocks(second)
    assert num_tokens == 8
    # 16 tokens need 4 blocks: 2 hits + 2 new, but only 1 block is free besides the hits
    assert kv.allocate_slots(second, 8, hits) is None
    assert kv.pool.free_block_ids() == [2, 1, 0]


def test_tenants_with_different_salts_never_share_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    alice = make_request("a", list(range(9)), salt="alice")
    kv.allocate_slots(alice, 9)
    compute(kv, alice, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), salt="bob")) == ([], 0)
    hits, _ = kv.get_computed_blocks(make_request("c", list(range(9)), salt="alice"))
    assert [b.block_id for b in hits] == [0, 1]
