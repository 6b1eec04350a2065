"""The `admit` policy (mesh.eviction: the reuse filter in front of LRU's order, holding back only classes reused at
less than 0.6 times the average). Exact hit counts on small deterministic traces, beside LRU's."""

from __future__ import annotations

from pathlib import Path

from kvmesh.bench.kvcache import load_trace, replay
from kvmesh.bench.kvcache_trace import generate_trace
from mesh.eviction.hint import BlockHint
from mesh.eviction.policies import LRUPolicy, make_policy
from mesh.eviction.reuse import ReusePolicy
from tests.mesh.test_eviction_duel import HOT, hits, scans_among_a_hot_set

CONVERSATION = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_trace_first300.jsonl"


def test_make_policy_builds_the_filter_in_front_of_lru_order() -> None:
    policy = make_policy("admit", 64)
    assert isinstance(policy, ReusePolicy)
    assert (policy.admission, policy.max_freq, policy.admit_ratio) == (True, 1, 0.6)


def test_where_one_off_blocks_flush_lru_the_filter_keeps_the_hot_set() -> None:
    accesses = scans_among_a_hot_set(600)
    assert hits(LRUPolicy(), accesses, 64) == 0
    assert hits(make_policy("admit", 64), accesses, 64) == 1020  # of 4800 hot accesses


def test_where_every_class_comes_back_alike_it_hits_as_lru_does() -> None:
    # Two classes, every block asked for again 64 accesses later, a new set of blocks every 3200 accesses: no class
    # is held back, so it hits what LRU hits, all but each block's first access.
    accesses = [(i % 64 + 1000 * (i // 3200), HOT if i % 2 else BlockHint(0, 1)) for i in range(9600)]
    assert hits(make_policy("admit", 80), accesses, 80) == hits(LRUPolicy(), accesses, 80) == 9600 - 3 * 64


def test_through_the_store_it_beats_lru_on_a_generated_trace() -> None:
    requests = generate_trace(num_requests=400, num_templates=40)  # 5248 unique blocks
    assert round(replay(requests, 300, "lru"), 4) == 0.2672
    assert round(replay(requests, 300, "admit"), 4) == 0.3329


def test_through_the_store_it_is_at_or_above_lru_on_the_conversation_trace() -> None:
    requests = load_trace(CONVERSATION)  # the first 300 requests: 7515 unique full blocks
    assert [round(replay(requests, capacity, "lru"), 4) for capacity in (751, 3757)] == [0.0365, 0.0543]
    assert [round(replay(requests, capacity, "admit"), 4) for capacity in (751, 3757)] == [0.0379, 0.0545]
