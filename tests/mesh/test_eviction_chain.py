"""The `chain` policy (mesh.eviction.chain): LRU in which a Put's new blocks sit just below the prefix they extend,
deeper blocks older. Exact victim orders, and exact hit rates through the store beside LRU's."""

from __future__ import annotations

import random

from kvmesh.bench.kvcache import replay
from kvmesh.bench.kvcache_trace import generate_trace
from mesh.eviction.chain import ChainPolicy
from mesh.eviction.hint import BlockHint
from mesh.eviction.policies import LRUPolicy, make_policy


def victims(policy: ChainPolicy | LRUPolicy) -> list[bytes]:
    order = []
    while (key := policy.victim()) is not None:
        order.append(key)
    return order


def test_a_run_extending_a_prefix_goes_before_the_prefix_deepest_first() -> None:
    chain, lru = ChainPolicy(), LRUPolicy()
    for policy in (chain, lru):
        policy.insert(b"x", 1, BlockHint(0, 1))  # an older, unrelated block
        policy.insert(b"a", 1, BlockHint(0, 2))
        policy.insert(b"b", 1, BlockHint(1, 2))
        policy.touch(b"b")  # a hit on [a, b], read last block first as the store reads it
        policy.touch(b"a")
        policy.insert(b"c", 1, BlockHint(0, 2, continues=True))  # the request's new blocks [c, d]
        policy.insert(b"d", 1, BlockHint(1, 2, continues=True))
    assert victims(chain) == [b"x", b"d", b"c", b"b", b"a"]
    assert victims(lru) == [b"x", b"b", b"a", b"c", b"d"]  # b goes first: c and d are then held for nothing


def test_a_new_chain_is_given_up_from_its_end() -> None:
    policy = ChainPolicy()
    for position, key in enumerate((b"a", b"b", b"c")):
        policy.insert(key, 1, BlockHint(position, 3))
    policy.insert(b"z", 1, BlockHint(0, 1))
    assert victims(policy) == [b"c", b"b", b"a", b"z"]


def test_without_hints_it_orders_as_lru() -> None:
    # A device cache gives no hints: every block a run of one, extending nothing.
    rng = random.Random(7)
    chain, lru = ChainPolicy(), LRUPolicy()
    held: set[bytes] = set()
    for _ in range(2000):
        key = bytes([rng.randrange(40)])
        if key in held:
            chain.touch(key)
            lru.touch(key)
        else:
            chain.insert(key, 1)
            lru.insert(key, 1)
            held.add(key)
        if len(held) > 16:
            victim = lru.victim()
            assert chain.victim() == victim
            held.discard(victim)  # type: ignore[arg-type]
    assert victims(chain) == victims(lru)


def test_through_the_store_the_head_outlives_its_tail() -> None:
    # room for two blocks: [9] pushes out LRU's oldest, the head of [1, 2]; chain gives up the tail 2 instead
    one_off = [(0.0, [1, 2]), (1.0, [9]), (2.0, [1, 2])]
    assert replay(one_off, capacity_blocks=2, policy="lru") == 0.0
    assert replay(one_off, capacity_blocks=2, policy="chain") == 1 / 5
    assert isinstance(make_policy("chain", 64), ChainPolicy)


def test_through_the_store_on_a_generated_trace() -> None:
    requests = generate_trace(num_requests=400, num_templates=40)  # 5248 unique blocks
    assert [round(replay(requests, capacity, "lru"), 4) for capacity in (300, 1000)] == [0.2672, 0.3997]
    assert [round(replay(requests, capacity, "chain"), 4) for capacity in (300, 1000)] == [0.2725, 0.3997]
