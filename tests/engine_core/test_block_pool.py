import pytest

from engine_core.kv_cache.block_hash import hash_block, root_hash
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored

ROOT = root_hash("m")
H = [hash_block(ROOT, [i, i]) for i in range(8)]


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_takes_the_head_of_the_free_queue():
    pool = BlockPool(4)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert pool.free_block_ids() == [3]
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="cannot allocate 2 blocks: 1 free"):
        pool.allocate(2)


def test_eviction_order_is_least_recently_freed_first():
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    pool.cache_blocks(a, H[0:2], ROOT, [0, 0, 1, 1], 2)
    pool.cache_blocks(b, H[2:4], H[1], [2, 2, 3, 3], 2)
    pool.free(reversed(a))
    pool.free(reversed(b))
    assert pool.free_block_ids() == [1, 0, 3, 2]

    assert ids(pool.allocate(3)) == [1, 0, 3]
    assert pool.take_events() == [
        BlockStored((H[0], H[1]), ROOT, (0, 0, 1, 1), 2),
        BlockStored((H[2], H[3]), H[1], (2, 2, 3, 3), 2),
        BlockRemoved((H[1],)),
        BlockRemoved((H[0],)),
        BlockRemoved((H[3],)),
    ]
    assert pool.num_evictions == 3
    assert pool.get_cached_block(H[2]).block_id == 2
    assert pool.get_cached_block(H[0]) is None


def test_touch_takes_a_cached_free_block_back_out_of_the_queue():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache_blocks([block], [H[0]], ROOT, [0, 0], 2)
    pool.free([block])
    assert pool.free_block_ids() == [1, 2, 0]
    hit = pool.get_cached_block(H[0])
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_block_ids() == [1, 2]
    pool.touch([hit])  # a second request shares it
    pool.free([hit])
    assert hit.ref_cnt == 1 and pool.free_block_ids() == [1, 2]
    pool.free([hit])
    assert pool.free_block_ids() == [1, 2, 0]
    assert hit.block_hash == H[0]  # still cached while free


def test_a_key_cached_twice_stays_with_the_first_block():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache_blocks([first], [H[0]], ROOT, [0, 0], 2)
    pool.cache_blocks([second], [H[0]], ROOT, [0, 0], 2)
    assert pool.get_cached_block(H[0]) is first
    assert second.block_hash is None
    assert len(pool.take_events()) == 1


def test_reset_is_refused_while_blocks_are_referenced():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.cache_blocks(blocks, [H[0]], ROOT, [0, 0], 2)
    assert pool.reset_prefix_cache() is False
    pool.free(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(H[0]) is None
    assert pool.take_events() == [AllBlocksCleared()]


def test_double_free_is_an_invariant_violation():
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_caching_disabled_registers_nothing():
    pool = BlockPool(1, enable_caching=False)
    blocks = pool.allocate(1)
    pool.cache_blocks(blocks, [H[0]], ROOT, [0, 0], 2)
    assert pool.get_cached_block(H[0]) is None and pool.take_events() == []
