"""`kvmesh bench kv-index`: how long a restarted process takes to rebuild the global KV index by replaying the
JetStream stream KVMESH_KV (embedded NATS). Publishes `batches` KVEventBatch of `blocks_per_batch` stored blocks
each (as store nodes do, over `num_workers` workers), then times a fresh follower from start to caught up."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from kvmesh.nats_server import EmbeddedNats
from mesh import subjects
from mesh.bus import Bus
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import KVEventFollower, ensure_kv_stream
from mesh.pb import events_pb2


async def _run(num_batches: int, blocks_per_batch: int, num_workers: int) -> dict[str, Any]:
    with EmbeddedNats() as nats:
        bus = await Bus.connect(nats.url, "bench-kv-index")
        await ensure_kv_stream(bus)
        js = bus.client.jetstream()
        started = time.perf_counter()
        for n in range(num_batches):
            worker = f"kv-{n % num_workers}"
            keys = [os.urandom(32) for _ in range(blocks_per_batch)]
            event = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(
                block_hashes=keys, fragment_indices=[n % 3] * len(keys), num_data_fragments=2, num_fragments=3))
            batch = events_pb2.KVEventBatch(worker_id=worker, seq=n // num_workers + 1, tier="host", events=[event])
            if n % 256 == 255:  # an acked publish now and then keeps the stream caught up with us
                await js.publish(subjects.kv_events(worker), batch.SerializeToString())
            else:
                await bus.client.publish(subjects.kv_events(worker), batch.SerializeToString())
        await bus.flush()
        publish_s = time.perf_counter() - started
        info = await js.stream_info("KVMESH_KV")
        index = GlobalKVIndex()
        follower = KVEventFollower(bus, index)
        await follower.start()
        assert await follower.wait_caught_up(timeout_s=600)
        replay_s = follower.replay_seconds or 0.0
        await follower.stop()
        await bus.close()
    return {"batches": int(info.state.messages), "blocks": index.num_blocks(), "stream_bytes": int(info.state.bytes),
            "replay_seconds": round(replay_s, 2), "batches_per_second": round(num_batches / max(replay_s, 1e-9)),
            "blocks_per_second": round(index.num_blocks() / max(replay_s, 1e-9)), "publish_seconds": round(publish_s, 2),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def run_index_bench(num_batches: int = 20_000, blocks_per_batch: int = 16, num_workers: int = 3) -> dict[str, Any]:
    return asyncio.run(_run(num_batches, blocks_per_batch, num_workers))
