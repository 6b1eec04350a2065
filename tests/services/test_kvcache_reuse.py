"""The `reuse` eviction policy, its frequency sketch and the hints the store gives it, on real objects with exact
eviction orders (no service, no NATS)."""

from __future__ import annotations

from mesh.eviction.hint import NO_HINT, BlockHint
from mesh.eviction.policies import make_policy
from mesh.eviction.reuse import ReusePolicy, class_of, run_bucket
from mesh.eviction.sketch import FrequencySketch
from services.kvcache.store import Block, BlockStore, StoreConfig
from tests.services.test_kvcache import BLOCK_BYTES, LAYOUT, ROOT, chain, key

ONE_OFF = BlockHint(0, 1)  # a run of one block: the class taught below never comes back
DOCUMENT = BlockHint(0, 16)  # a run of 16: the class taught below always does


def k(i: int) -> bytes:
    return i.to_bytes(4, "little")


def drain(policy: ReusePolicy) -> list[int]:
    order = []
    while (victim := policy.victim()) is not None:
        order.append(int.from_bytes(victim, "little"))
    return order


def test_the_sketch_counts_caps_at_15_and_halves_every_ten_increments_per_counter() -> None:
    sketch = FrequencySketch(num_keys=4)  # 4 counters a row: a halving every 40 increments
    for _ in range(20):
        sketch.increment(b"a")
    assert sketch.frequency(b"a") == 15
    assert sketch.frequency(b"never") <= 15  # count-min: never below the truth, here 0 or a collision
    for _ in range(20):
        sketch.increment(b"b")  # the 40th increment halves everything
    assert sketch.frequency(b"a") == 7
    assert sketch.num_bytes == 16


def test_run_buckets_double() -> None:
    assert [run_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 300)] == [0, 0, 1, 1, 2, 2, 3, 8]
    assert class_of(BlockHint(3, 16, True, "agent")) == (4, True, "agent")


def taught() -> ReusePolicy:
    """A policy (no window room) that saw 20 one-off blocks never used again and 20 document blocks all reused."""
    policy = ReusePolicy(capacity_bytes=0)
    for i in range(20):
        policy.insert(k(100 + i), 1, ONE_OFF)
        policy.insert(k(200 + i), 1, DOCUMENT)
        policy.touch(k(200 + i))
    # from the second one-off on, its class is below the average (0.444 < 0.9 x 0.5): the window, drained first
    assert drain(policy) == [*range(101, 120), 100, *range(200, 220)]
    return policy


def test_the_policy_learns_which_classes_come_back() -> None:
    policy = taught()
    assert round(policy.reuse_rate(class_of(ONE_OFF)), 3) == round((0 + 0.5 * 8) / (20 + 8), 3)
    assert round(policy.reuse_rate(class_of(DOCUMENT)), 3) == round((20 + 0.5 * 8) / (20 + 8), 3)
    assert not policy.admits(class_of(ONE_OFF))
    assert policy.admits(class_of(DOCUMENT))


def test_a_block_not_admitted_waits_in_the_window_and_goes_first() -> None:
    policy = taught()
    policy.insert(k(1), 1, DOCUMENT)
    policy.insert(k(2), 1, ONE_OFF)  # not admitted
    policy.insert(k(3), 1, DOCUMENT)
    assert len(policy) == 3
    assert drain(policy) == [2, 1, 3]


def test_a_key_seen_before_is_admitted_and_a_hit_in_the_window_admits_it() -> None:
    policy = taught()
    policy.insert(k(100), 1, ONE_OFF)  # evicted before, remembered by the sketch: admitted
    policy.insert(k(1), 1, ONE_OFF)  # new: to the window
    policy.touch(k(1))  # a hit there: admitted with that hit, above 100
    policy.insert(k(2), 1, ONE_OFF)
    assert drain(policy) == [2, 100, 1]


def test_make_policy_knows_reuse() -> None:
    assert isinstance(make_policy("reuse", 10), ReusePolicy)


class Recorder:
    """An EvictionPolicy that keeps every hint it is given (LRU otherwise)."""

    def __init__(self) -> None:
        self.hints: dict[bytes, BlockHint] = {}
        self.keys: list[bytes] = []

    def insert(self, key: bytes, size: int, hint: BlockHint = NO_HINT) -> None:
        self.hints[key] = hint
        self.keys.append(key)

    def touch(self, key: bytes) -> None: ...

    def remove(self, key: bytes) -> None:
        self.keys.remove(key)

    def victim(self) -> bytes | None:
        return self.keys.pop(0) if self.keys else None

    def __len__(self) -> int:
        return len(self.keys)


def test_the_store_hints_each_block_with_its_place_in_the_chain_run_of_its_put() -> None:
    store = BlockStore(StoreConfig(host_capacity_bytes=16 * BLOCK_BYTES, policy="reuse"))
    recorder = Recorder()
    store.host.policy = recorder
    store.put(chain(1, 2, 3))
    lone = Block(key(9), ROOT, LAYOUT, bytes(BLOCK_BYTES), traffic_class="agent")
    store.put(
        [Block(key(4), key(3), LAYOUT, bytes(BLOCK_BYTES)), Block(key(5), key(4), LAYOUT, bytes(BLOCK_BYTES)), lone]
    )
    assert [recorder.hints[key(i)] for i in (1, 2, 3, 4, 5, 9)] == [
        BlockHint(0, 3, False),
        BlockHint(1, 3, False),
        BlockHint(2, 3, False),
        BlockHint(0, 2, True),  # extends 3, which the store holds
        BlockHint(1, 2, True),
        BlockHint(0, 1, False, "agent"),
    ]
