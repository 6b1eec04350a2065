"""`kvmesh bench kv-index`: how long a restarted process takes to rebuild the global KV index (embedded NATS), by
replaying the JetStream stream KVMESH_KV and, in the same run, from a compacted stream (`mesh.kv_snapshot`).

Publishes `batches` KVEventBatch of `blocks_per_batch` stored blocks each (as store nodes do, over `num_workers`
workers). With `live_batches`, caches churn as they do in service: each batch also removes the blocks its worker
stored `live_batches` batches earlier, so the stream grows while the index stays the same size. Then:
  1. a fresh follower replays the whole stream (`replay_seconds`);
  2. that follower's index is snapshotted and the stream purged below it (`snapshot_seconds`: KVIndexCompactor);
  3. another fresh follower restores the snapshot (`restore_seconds`), and its index is checked equal.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from kvmesh.nats_server import EmbeddedNats
from mesh import subjects
from mesh.bus import Bus
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import STREAM, KVEventFollower, KVIndexCompactor, ensure_kv_stream
from mesh.pb import events_pb2


def _batches(
    num_batches: int, blocks_per_batch: int, num_workers: int, live_batches: int | None
) -> list[events_pb2.KVEventBatch]:
    stored: list[list[bytes]] = []
    batches = []
    for n in range(num_batches):
        keys = [os.urandom(32) for _ in range(blocks_per_batch)]
        stored.append(keys)
        events = [
            events_pb2.KVEvent(
                stored=events_pb2.KVBlocksStored(
                    block_hashes=keys, fragment_indices=[n % 3] * len(keys), num_data_fragments=2, num_fragments=3
                )
            )
        ]
        old = n - live_batches * num_workers if live_batches is not None else -1
        if old >= 0:  # the same worker's batch `live_batches` of its own batches ago
            events.append(events_pb2.KVEvent(removed=events_pb2.KVBlocksRemoved(block_hashes=stored[old])))
        batches.append(
            events_pb2.KVEventBatch(
                worker_id=f"kv-{n % num_workers}", seq=n // num_workers + 1, tier="host", events=events
            )
        )
    return batches


async def _rebuilt(bus: Bus) -> KVEventFollower:
    follower = KVEventFollower(bus, GlobalKVIndex())
    await follower.start()
    assert await follower.wait_caught_up(timeout_s=600)
    return follower


async def _run(num_batches: int, blocks_per_batch: int, num_workers: int, live_batches: int | None) -> dict[str, Any]:
    batches = _batches(num_batches, blocks_per_batch, num_workers, live_batches)
    with EmbeddedNats() as nats:
        bus = await Bus.connect(nats.url, "bench-kv-index")
        await ensure_kv_stream(bus)
        js = bus.client.jetstream()
        started = time.perf_counter()
        for n, batch in enumerate(batches):
            subject, data = subjects.kv_events(batch.worker_id), batch.SerializeToString()
            if n % 256 == 255:  # an acked publish now and then keeps the stream caught up with us
                await js.publish(subject, data)
            else:
                await bus.client.publish(subject, data)
        await bus.flush()
        info = await js.stream_info(STREAM)
        while info.state.last_seq < num_batches:  # the server has them all; the stream stores the last few
            await asyncio.sleep(0.01)
            info = await js.stream_info(STREAM)
        publish_s = time.perf_counter() - started

        replayed = await _rebuilt(bus)
        await replayed.stop()
        compactor = KVIndexCompactor(replayed, every=1)
        started = time.perf_counter()
        assert await compactor.compact()
        snapshot_s = time.perf_counter() - started
        snapshot_bytes = replayed.index.to_snapshot(replayed.last_stream_seq).ByteSize()

        restored = await _rebuilt(bus)
        await restored.stop()
        assert restored.num_restores == 1 and restored.num_replayed == 0
        same = restored.index.to_snapshot(0) == replayed.index.to_snapshot(0)
        await bus.close()
    replay_s, restore_s = replayed.replay_seconds or 0.0, restored.replay_seconds or 0.0
    blocks = replayed.index.num_blocks()
    return {
        "batches": int(info.state.messages),
        "blocks": blocks,
        "stream_bytes": int(info.state.bytes),
        "live_batches": live_batches,
        "replay_seconds": round(replay_s, 2),
        "batches_per_second": round(num_batches / max(replay_s, 1e-9)),
        "blocks_per_second": round(blocks / max(replay_s, 1e-9)),
        "snapshot_seconds": round(snapshot_s, 2),
        "snapshot_bytes": snapshot_bytes,
        "restore_seconds": round(restore_s, 2),
        "replay_over_restore": round(replay_s / max(restore_s, 1e-9), 1),
        "restored_index_equal": same,
        "publish_seconds": round(publish_s, 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def run_index_bench(
    num_batches: int = 20_000, blocks_per_batch: int = 16, num_workers: int = 3, live_batches: int | None = None
) -> dict[str, Any]:
    return asyncio.run(_run(num_batches, blocks_per_batch, num_workers, live_batches))
