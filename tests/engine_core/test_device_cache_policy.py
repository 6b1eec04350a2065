"""The device prefix cache's eviction order under a mesh.eviction policy (KVMESH_DEVICE_CACHE_POLICY): exact block
ids on a real BlockPool, and the setting refused at start when it names no policy."""

from __future__ import annotations

import pytest

from engine_core.config import ConfigError, EngineConfig
from engine_core.kv_cache.block_hash import hash_block, root_hash
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.manager import KVCacheManager
from mesh.compute.settings import WorkerSettings
from mesh.config import SettingError, load_settings
from mesh.eviction.policies import LFUDAPolicy, make_policy

ROOT = root_hash("m")
H = [hash_block(ROOT, [i, i]) for i in range(8)]


def ids(blocks):
    return [b.block_id for b in blocks]


def one_cached(pool, block_hash):
    (block,) = pool.allocate(1)
    pool.cache_blocks([block], [block_hash], ROOT, [0, 0], 2)
    pool.free([block])
    return block


@pytest.mark.parametrize(
    ("policy", "evicted"),
    [
        (None, [0, 1, 2]),  # the pool's own queue: least recently freed first, the reused block too
        ("lru", [0, 1, 2]),  # mesh.eviction's LRU through the hook: the same order
        ("lfuda", [1, 2, 3]),  # the block reused once outranks three used once
        ("s3fifo", [1, 2, 3]),  # its hit moves it to the main queue; the others leave the small one
    ],
)
def test_a_policy_decides_which_free_cached_block_goes_first(policy, evicted):
    pool = BlockPool(4, eviction=make_policy(policy, 4) if policy else None)
    reused = one_cached(pool, H[0])
    pool.touch([reused])  # a request hits it, then ends
    pool.free([reused])
    for i in (1, 2, 3):
        assert one_cached(pool, H[i]).block_id == i
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    assert ids(pool.allocate(3)) == evicted
    survivor = ({0, 1, 2, 3} - set(evicted)).pop()
    assert pool.get_cached_block(H[survivor]).block_id == survivor
    assert pool.num_evictions == 3


def test_with_a_policy_uncached_free_blocks_go_before_any_cached_one():
    pool = BlockPool(3, eviction=LFUDAPolicy())
    first, second = pool.allocate(2)
    pool.cache_blocks([first], [H[0]], ROOT, [0, 0], 2)
    pool.free([first, second])
    assert pool.free_block_ids() == [2, 1, 0]
    assert ids(pool.allocate(2)) == [2, 1]  # the pool's own queue would give [2, 0], evicting H[0]
    assert pool.get_cached_block(H[0]) is first and pool.num_evictions == 0


def test_with_a_policy_uncache_and_reset_hand_blocks_back_to_the_queue():
    pool = BlockPool(2, eviction=LFUDAPolicy())
    a, b = one_cached(pool, H[0]), one_cached(pool, H[1])
    assert (a.block_id, b.block_id) == (0, 1)
    pool.uncache([a])
    assert pool.free_block_ids() == [0, 1] and pool.get_cached_block(H[0]) is None
    assert pool.reset_prefix_cache() is True
    assert pool.free_block_ids() == [0, 1] and pool.num_cached_blocks == 0
    assert ids(pool.allocate(2)) == [0, 1]


def test_the_manager_builds_the_named_policy():
    pool = KVCacheManager(4, 2, eviction_policy="lfuda").pool
    reused = one_cached(pool, H[0])
    pool.touch([reused])
    pool.free([reused])
    for i in (1, 2, 3):
        one_cached(pool, H[i])
    assert ids(pool.allocate(3)) == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        KVCacheManager(4, 2, eviction_policy="mru")


def test_an_unknown_policy_is_refused_at_start_naming_the_setting():
    with pytest.raises(
        SettingError, match="KVMESH_DEVICE_CACHE_POLICY='mru': must be one of lru, s3fifo, lfuda, reuse, admit, chain"
    ):
        load_settings(WorkerSettings, env={"KVMESH_DEVICE_CACHE_POLICY": "mru"})
    assert (
        load_settings(WorkerSettings, env={"KVMESH_DEVICE_CACHE_POLICY": "lfuda"})
        .engine_config("smollm2-135m")
        .device_cache_policy
        == "lfuda"
    )
    expected = "device_cache_policy must be one of lru, s3fifo, lfuda, reuse, admit, chain, got 'mru'"
    with pytest.raises(ConfigError, match=expected):
        EngineConfig("smollm2-135m", device_cache_policy="mru")
