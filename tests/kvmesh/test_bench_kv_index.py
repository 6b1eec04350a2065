"""`kvmesh bench kv-index` at a small size: the replayed and the restored index agree, the counts are exact."""

from __future__ import annotations

from kvmesh.bench.kv_index import run_index_bench


def test_replay_and_restore_from_a_snapshot_build_the_same_index() -> None:
    report = run_index_bench(num_batches=300, blocks_per_batch=4, num_workers=3, live_batches=20)
    # each worker keeps its last 20 batches of 4 blocks; the stream keeps all 300 batches until the snapshot
    assert (report["batches"], report["blocks"], report["live_batches"]) == (300, 3 * 20 * 4, 20)
    assert report["restored_index_equal"] is True
    assert report["snapshot_bytes"] > 3 * 20 * 4 * 32  # every key is in it
