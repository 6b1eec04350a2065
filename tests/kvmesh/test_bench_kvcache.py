"""The trace-replay benchmark's arithmetic on traces small enough to work out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.kvcache import (
    belady_hit_rate,
    class_oracle_lru_hit_rate,
    ideal_hit_rate,
    load_trace,
    replay,
    reuse_oracle_lru_hit_rate,
)
from kvmesh.bench.kvcache_trace import generate_trace

# Two chains used twice each, alternating; room for two blocks.
TRACE = [(0.0, [1, 2]), (1.0, [3]), (2.0, [1, 2]), (3.0, [3])]


def test_ideal_counts_every_block_seen_before() -> None:
    assert ideal_hit_rate(TRACE) == 3 / 6


def test_belady_keeps_what_returns_soonest() -> None:
    # [3] evicts itself (used again last), so [1, 2] hit; [3] then misses.
    assert belady_hit_rate(TRACE, capacity_blocks=2) == 2 / 6
    assert belady_hit_rate(TRACE, capacity_blocks=3) == 3 / 6


def test_lru_in_the_real_store_thrashes_on_this_trace() -> None:
    # [3] pushes out 1, so [1, 2] misses at its head: nothing after a miss counts.
    assert replay(TRACE, capacity_blocks=2, policy="lru") == 0.0
    assert replay(TRACE, capacity_blocks=3, policy="lru") == 3 / 6


def test_an_lru_that_skips_blocks_never_used_again_keeps_the_chain() -> None:
    one_off = [(0.0, [1, 2]), (1.0, [9]), (2.0, [1, 2])]
    assert replay(one_off, capacity_blocks=2, policy="lru") == 0.0  # [9] pushed out the head of [1, 2]
    assert reuse_oracle_lru_hit_rate(one_off, capacity_blocks=2) == 2 / 5  # [9] was never stored
    # [1, 2] misses as under LRU, but 1 is not stored again (never used again), so [3] survives to hit
    assert reuse_oracle_lru_hit_rate(TRACE, capacity_blocks=2) == 1 / 6


def test_a_mooncake_request_keeps_its_full_blocks_only(tmp_path: Path) -> None:
    # input_length 1100 is two full blocks and 76 tokens: hash_id 3 is a partial block no live store holds.
    records = [(0, 1100, [1, 2, 3]), (1000, 1100, [1, 2, 3]), (2000, 1024, [1, 2]), (3000, 300, [4])]
    path = tmp_path / "trace.jsonl"
    lines = [json.dumps({"timestamp": t, "input_length": n, "hash_ids": ids}) for t, n, ids in records]
    path.write_text("\n".join(lines) + "\n")
    requests = load_trace(path)
    assert requests == [(0.0, [1, 2]), (1.0, [1, 2]), (2.0, [1, 2]), (3.0, [])]
    # The same prompt sent again hits its two full blocks, not the partial one (which would make it 5 of 9).
    assert ideal_hit_rate(requests) == replay(requests, capacity_blocks=2, policy="lru") == 4 / 6
    assert belady_hit_rate(requests, capacity_blocks=2) == reuse_oracle_lru_hit_rate(requests, 2) == 4 / 6


def test_the_generated_trace_is_the_same_every_run() -> None:
    trace = load_trace("generated")
    assert trace == generate_trace()
    assert len(trace) == 6000 and trace[0][0] == 0.0 and trace[-1][0] == pytest.approx(599.9)
    assert sum(len(ids) for _, ids in trace) == sum(len(ids) for _, ids in generate_trace())
    small = generate_trace(num_requests=50, num_templates=3, seed=1)
    heads = {ids[0] for _, ids in small}
    assert len(heads) < 50  # templates repeat: their first blocks are shared


def test_the_class_oracle_admits_by_the_true_reuse_of_a_run_length() -> None:
    one_off = [(0.0, [1, 2]), (1.0, [9]), (2.0, [1, 2])]
    # runs of 2 are always reused, runs of 1 never: [9] is not stored, so [1, 2] hits
    assert class_oracle_lru_hit_rate(one_off, capacity_blocks=2) == 2 / 5
    mixed = [(0.0, [1, 2]), (1.0, [3, 4]), (2.0, [1, 2]), (3.0, [5, 6])]
    # runs of 2: half of the 6 first-seen blocks come back; at a threshold of 0.5 or less all are stored
    assert class_oracle_lru_hit_rate(mixed, capacity_blocks=2) == 0.0
    assert class_oracle_lru_hit_rate(mixed, capacity_blocks=4) == 2 / 8
