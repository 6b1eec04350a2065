"""Rendezvous placement: the same owner in every process, balanced, and stable when nodes come and go."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from mesh.placement import rank_nodes, rendezvous_owner

NODES = ["kvcache-a", "kvcache-b", "kvcache-c"]
KEYS = [hashlib.sha256(str(i).encode()).digest() for i in range(3000)]


def test_owners_are_fixed_values_so_every_process_agrees():
    # literal expectations: a per-process salted hash would not reproduce them
    assert [rendezvous_owner(bytes([i]), NODES) for i in range(8)] == [
        "kvcache-b",
        "kvcache-b",
        "kvcache-c",
        "kvcache-c",
        "kvcache-a",
        "kvcache-a",
        "kvcache-a",
        "kvcache-a",
    ]


def test_the_owner_ignores_node_order_and_heads_the_ranking():
    for key in KEYS[:100]:
        owner = rendezvous_owner(key, NODES)
        assert rendezvous_owner(key, list(reversed(NODES))) == owner
        assert rank_nodes(key, NODES)[0] == owner
        assert sorted(rank_nodes(key, NODES + NODES)) == sorted(NODES)


def test_keys_spread_evenly():
    counts = Counter(rendezvous_owner(key, NODES) for key in KEYS)
    assert set(counts) == set(NODES)
    assert all(900 <= n <= 1100 for n in counts.values()), counts


def test_only_the_keys_of_a_leaving_node_move_and_a_joining_node_only_takes_keys():
    before = {key: rendezvous_owner(key, NODES) for key in KEYS}
    after_leave = {key: rendezvous_owner(key, NODES[:2]) for key in KEYS}
    assert all(after_leave[k] == owner for k, owner in before.items() if owner != "kvcache-c")
    after_join = {key: rendezvous_owner(key, [*NODES, "kvcache-d"]) for key in KEYS}
    moved = [k for k in KEYS if after_join[k] != before[k]]
    assert all(after_join[k] == "kvcache-d" for k in moved)
    assert 600 <= len(moved) <= 900  # about a quarter of the keys


def test_no_nodes_is_an_error():
    with pytest.raises(ValueError, match="no nodes"):
        rendezvous_owner(b"key", [])
