"""The per-event and per-block costs `kvmesh bench scale` measures in its own process, on the mesh's own code:

  index_bytes_per_key, index_bytes_per_holding   GlobalKVIndex filled by KV event batches, weighed by tracemalloc:
      keys with one holder, then the same number of keys with 12 holders (10+2 fragments); the difference is the
      holdings' cost, the rest the keys'.
  index_apply_us_per_key   GlobalKVIndex.apply of stored batches, then of the removed batches, per key (median of
      `repeats` rounds).
  event_batch_bytes        a KVEventBatch of `keys_per_batch` stored fragments (32-byte keys), serialized.
  snapshot_bytes_per_holding, restore_holdings_per_s   the 12-holder index as a KVIndexSnapshot: its bytes per
      holding, and FromString + GlobalKVIndex.restore per holding (median).
  route_us, apply_assignment_us   Router("kvmesh") over 16 prefill and 16 decode workers, a prompt of
      `prompt_tokens` (its blocks half cached on one worker): one decision, and applying a peer replica's one.

Each takes well under a second at the default sizes; the machine is shared, so rounds are repeated and medians kept.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace

from mesh.kv_index import GlobalKVIndex
from mesh.pb import events_pb2
from mesh.routing import Router, RouteRequest, WorkerState

NUM_FRAGMENTS = 12  # 10 + 2: the holders an SSD block has in the index


def _stored_batches(keys: list[bytes], num_workers: int, keys_per_batch: int) -> list[events_pb2.KVEventBatch]:
    """Every key stored on `num_workers` workers (worker w holding fragment w), `keys_per_batch` keys a batch."""
    batches = []
    for worker in range(num_workers):
        for seq, start in enumerate(range(0, len(keys), keys_per_batch), start=1):
            chunk = keys[start : start + keys_per_batch]
            stored = events_pb2.KVBlocksStored(
                block_hashes=chunk, fragment_indices=[worker] * len(chunk), num_data_fragments=10, num_fragments=12
            )
            batches.append(
                events_pb2.KVEventBatch(
                    worker_id=f"kv-{worker}", seq=seq, tier="ssd", events=[events_pb2.KVEvent(stored=stored)]
                )
            )
    return batches


def _removed_batches(stored: list[events_pb2.KVEventBatch], seq_offset: int) -> list[events_pb2.KVEventBatch]:
    return [
        events_pb2.KVEventBatch(
            worker_id=batch.worker_id,
            seq=batch.seq + seq_offset,
            tier="ssd",
            events=[
                events_pb2.KVEvent(removed=events_pb2.KVBlocksRemoved(block_hashes=batch.events[0].stored.block_hashes))
            ],
        )
        for batch in stored
    ]


def _weigh(batches: list[events_pb2.KVEventBatch]) -> tuple[GlobalKVIndex, int]:
    gc.collect()
    tracemalloc.start()
    index = GlobalKVIndex()
    for batch in batches:
        index.apply(batch)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return index, used


def index_costs(num_keys: int, keys_per_batch: int, repeats: int) -> dict[str, float]:
    """Memory per key and per holding, apply time per key, snapshot bytes and restore rate per holding."""
    keys = [os.urandom(32) for _ in range(num_keys)]
    _, one = _weigh(_stored_batches(keys, 1, keys_per_batch))
    stored = _stored_batches(keys, NUM_FRAGMENTS, keys_per_batch)
    index, many = _weigh(stored)
    per_holding = (many - one) / (num_keys * (NUM_FRAGMENTS - 1))
    holdings = num_keys * NUM_FRAGMENTS
    removed = _removed_batches(stored, len(stored))
    apply_s = []
    for _ in range(repeats):
        fresh = GlobalKVIndex()
        started = time.perf_counter()
        for batch in (*stored, *removed):
            fresh.apply(batch)
        apply_s.append(time.perf_counter() - started)
        assert fresh.num_blocks() == 0
    snapshot = index.to_snapshot(1).SerializeToString()
    restore_s = []
    for _ in range(repeats):
        started = time.perf_counter()
        GlobalKVIndex().restore(events_pb2.KVIndexSnapshot.FromString(snapshot))
        restore_s.append(time.perf_counter() - started)
    return {
        "index_bytes_per_key": round(one / num_keys - per_holding, 1),
        "index_bytes_per_holding": round(per_holding, 1),
        "index_apply_us_per_key": round(statistics.median(apply_s) / (2 * holdings) * 1e6, 3),
        "snapshot_bytes_per_holding": round(len(snapshot) / holdings, 2),
        "restore_holdings_per_s": round(holdings / statistics.median(restore_s)),
    }


def event_batch_bytes(keys_per_batch: int) -> int:
    keys = [os.urandom(32) for _ in range(keys_per_batch)]
    batch = _stored_batches(keys, 1, keys_per_batch)[0]
    return as_in_service(batch).ByteSize()


def as_in_service(batch: events_pb2.KVEventBatch) -> events_pb2.KVEventBatch:
    """The batch as a store node names itself in service (a uuid-length worker id, a seq in the millions)."""
    renamed = events_pb2.KVEventBatch()
    renamed.CopyFrom(batch)
    renamed.worker_id, renamed.seq = "kvcache-0123456789abcdef", 12_345_678
    return renamed


def _median_us(call: Callable[[int], object], repeats: int) -> float:
    samples = []
    for n in range(repeats):
        started = time.perf_counter()
        call(n)
        samples.append(time.perf_counter() - started)
    return round(statistics.median(samples) * 1e6, 2)


def route_costs(prompt_tokens: int, repeats: int, num_workers: int = 16) -> dict[str, float]:
    block_hashes = tuple(os.urandom(32) for _ in range(max(1, prompt_tokens // 16)))
    index = GlobalKVIndex()
    index.add("prefill-0", block_hashes[: len(block_hashes) // 2])
    router = Router("kvmesh", index, balancer_id="bench")
    prefill = [WorkerState(f"prefill-{n}", 0.0, max_num_seqs=8, num_kv_blocks=10_000) for n in range(num_workers)]
    decode = [WorkerState(f"decode-{n}", 0.0, max_num_seqs=64, num_kv_blocks=100_000) for n in range(num_workers)]
    assignments = []

    def route(n: int) -> None:
        request = RouteRequest("bench", block_hashes, prompt_tokens, request_id=f"r{n}")
        assignments.append(router.route(request, prefill, decode, now_s=n * 1e-3)[1])

    route_us = _median_us(route, repeats)
    peer = Router("kvmesh", GlobalKVIndex(), balancer_id="peer")
    apply_us = _median_us(lambda n: peer.apply(replace(assignments[n], request_id=f"p{n}")), repeats)
    return {"route_us": route_us, "apply_assignment_us": apply_us}


def measure(prompt_tokens: int, keys_per_batch: int, num_keys: int = 4_000, repeats: int = 3) -> dict[str, float]:
    """Every MEASURED input of scale_model, as this process measures it now."""
    return {
        **index_costs(num_keys, keys_per_batch, repeats),
        "event_batch_bytes": event_batch_bytes(keys_per_batch),
        **route_costs(prompt_tokens, repeats=max(repeats, 50)),
    }
