"""Each engine's KV cache events, out of the process: every batch to NATS (the balancer's cache-aware index
follows them), and the bytes of newly stored blocks to the KV store.

`hook(model)` is that model's AsyncEngine hook. It runs on the engine thread right after a step, reads the new
blocks' bytes at once (a later step could evict them) and hands everything to the event loop, where batches
are numbered (`seq`, one sequence per worker) and published in order through an outbox (mesh.outbox: plain NATS
publishes, kept while NATS is away and sent when it returns; each with a `Nats-Msg-Id`, so the KVMESH_KV stream
keeps one copy of a batch sent twice). When the outbox overflows, its oldest batch is dropped: a follower sees the
gap in `seq`, and a device cache is only a routing hint.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine_core import LLMEngine
from engine_core.async_engine import KVEventHook
from engine_core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from mesh import subjects
from mesh.bus import Bus
from mesh.discovery import now_ms
from mesh.logging import get_logger
from mesh.outbox import Envelope, Outbox
from mesh.pb import events_pb2
from services.prefill.prefiller import StoreBlock
from services.prefill.store_client import StoreWriter

TIER = "device"
MAX_UNPUBLISHED_BATCHES = 4096
log = get_logger(__name__)


def event_to_proto(event: KVCacheEvent, model: str) -> events_pb2.KVEvent:
    if isinstance(event, BlockStored):
        return events_pb2.KVEvent(
            stored=events_pb2.KVBlocksStored(
                block_hashes=event.block_hashes,
                parent_hash=event.parent_hash or b"",
                block_size=event.block_size,
                model=model,
            )
        )
    if isinstance(event, BlockRemoved):
        return events_pb2.KVEvent(removed=events_pb2.KVBlocksRemoved(block_hashes=event.block_hashes, model=model))
    assert isinstance(event, AllBlocksCleared)
    return events_pb2.KVEvent(all_cleared=True)


def read_stored_blocks(engine: LLMEngine, events: list[KVCacheEvent], skip: set[bytes]) -> list[StoreBlock]:
    """On the engine thread: the KV of every block the events stored, each with its parent in the chain."""
    layout = engine.kv_layout
    blocks: list[StoreBlock] = []
    for event in events:
        if not isinstance(event, BlockStored):
            continue
        parents = [event.parent_hash or b"", *event.block_hashes[:-1]]
        keys = [(key, parent) for key, parent in zip(event.block_hashes, parents, strict=True) if key not in skip]
        datas = engine.read_cached_blocks([key for key, _ in keys])
        blocks += [
            StoreBlock(key, parent, layout, data)
            for (key, parent), data in zip(keys, datas, strict=True)
            if data is not None
        ]
    return blocks


@dataclass
class _EngineSide:
    """What one engine's hook keeps; written only by that engine's thread."""

    injected: set[bytes] = field(default_factory=set)  # keys just entered from the store: never put them back
    num_cached_blocks: int = 0  # the prefix cache's size after the last step that changed it


class KVEventRelay:
    def __init__(
        self, worker_id: str, bus: Bus, writer: StoreWriter | None, capacity: int = MAX_UNPUBLISHED_BATCHES
    ) -> None:
        self.worker_id = worker_id
        self.bus = bus
        self.writer = writer
        self.seq = 0  # written only by _on_loop
        self._sides: dict[str, _EngineSide] = {}  # one entry per model, made before its engine starts
        self.outbox = Outbox(bus, capacity, jetstream=False)
        self._epoch = now_ms()  # with seq, each batch's Nats-Msg-Id
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.outbox.start()

    async def stop(self) -> None:
        await self.outbox.stop(timeout_s=1.0)

    def hook(self, model: str) -> KVEventHook:
        side = self._sides.setdefault(model, _EngineSide())

        def on_kv_events(engine: LLMEngine, events: list[KVCacheEvent]) -> None:
            # every event since the last hook is here, including those of an injection, so `injected` is done
            skip, side.injected = side.injected, set()
            blocks: list[StoreBlock] = []
            if self.writer is not None and self.writer.is_accepting:
                blocks = read_stored_blocks(engine, events, skip)
            side.num_cached_blocks = engine.kv.pool.num_cached_blocks
            assert self._loop is not None, "start() before the engines"
            self._loop.call_soon_threadsafe(self._on_loop, model, events, blocks)

        return on_kv_events

    def note_injected(self, model: str, block_hashes: list[bytes]) -> None:
        """On the engine thread, from the injection: these keys came from the store, so skip putting them."""
        self._sides[model].injected.update(block_hashes)

    @property
    def num_cached_blocks(self) -> int:
        return sum(side.num_cached_blocks for side in self._sides.values())

    def _on_loop(self, model: str, events: list[KVCacheEvent], blocks: list[StoreBlock]) -> None:
        self.seq += 1  # numbered even if dropped below: a follower sees the gap and resynchronises
        batch = events_pb2.KVEventBatch(
            worker_id=self.worker_id, seq=self.seq, tier=TIER, events=[event_to_proto(e, model) for e in events]
        )
        msg_id = f"{self.worker_id}.{self._epoch}.{self.seq}"
        self.outbox.put(Envelope(subjects.kv_events(self.worker_id), batch.SerializeToString(), msg_id))
        if blocks and self.writer is not None:
            self.writer.offer(blocks)
