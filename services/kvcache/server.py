"""The KVCache servicer and `serve()`: protobuf <-> store dataclasses, KV events on NATS, metrics.

The store's changes are published as KVEventBatch (tier "host") on kvmesh.kv.<worker_id>, numbered by `seq`.
A handler changes the store and asks for the publish without yielding in between, and publishes are serialized
in that order, so batches leave in the order the changes happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn

import grpc.aio

from mesh import metrics, rpc, subjects
from mesh.bus import Bus
from mesh.logging import get_logger
from mesh.pb import common_pb2, events_pb2, kvcache_pb2, kvcache_pb2_grpc
from mesh.service import Lifecycle, ServiceRuntime
from services.kvcache.config import KVCacheSettings
from services.kvcache.store import (
    Block,
    BlockError,
    BlocksRemoved,
    BlocksStored,
    HostBlockStore,
    KVLayout,
    StoreEvent,
)

TIER = "host"
log = get_logger(__name__)


def layout_from_pb(layout: common_pb2.KVLayout) -> KVLayout:
    return KVLayout(model=layout.model, dtype=layout.dtype, block_size=layout.block_size,
                    num_layers=layout.num_layers, layer_shape=tuple(layout.layer_shape), block_axis=layout.block_axis)


def layout_to_pb(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(model=layout.model, dtype=layout.dtype, block_size=layout.block_size,
                               num_layers=layout.num_layers, layer_shape=layout.layer_shape,
                               block_axis=layout.block_axis)


def block_from_pb(block: kvcache_pb2.Block) -> Block:
    if not block.HasField("layout"):
        raise BlockError(f"block {block.block_hash.hex()[:16]} has no layout")
    return Block(block.block_hash, block.parent_hash, layout_from_pb(block.layout), block.data)


def block_to_pb(block: Block) -> kvcache_pb2.Block:
    return kvcache_pb2.Block(block_hash=block.block_hash, parent_hash=block.parent_hash,
                             layout=layout_to_pb(block.layout), data=block.data)


def required_model(model: str) -> str:
    if not model:
        raise ValueError("model is required (a block of another model never matches)")
    return model


def event_to_pb(event: StoreEvent) -> events_pb2.KVEvent:
    if isinstance(event, BlocksStored):
        return events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(
            block_hashes=event.block_hashes, parent_hash=event.parent_hash, block_size=event.block_size,
            model=event.model))
    return events_pb2.KVEvent(removed=events_pb2.KVBlocksRemoved(block_hashes=event.block_hashes, model=event.model))


class EventPublisher:
    """This node's KV event stream. Only `publish` writes `seq` (under the lock, so numbers follow call order)."""

    def __init__(self, bus: Bus, worker_id: str) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.seq = 0
        self._lock = asyncio.Lock()  # FIFO: callers are served in the order they called

    async def publish(self, events: Sequence[StoreEvent]) -> None:
        if not events:
            return
        async with self._lock:
            self.seq += 1
            batch = events_pb2.KVEventBatch(worker_id=self.worker_id, seq=self.seq, tier=TIER,
                                            events=[event_to_pb(e) for e in events])
            try:
                await self.bus.publish(subjects.kv_events(self.worker_id), batch)
            except Exception:  # a lost batch shows as a seq gap to followers: at worst a cache miss
                log.warning("KV event batch not published", seq=self.seq, exc_info=True)


def export_metrics(store: HostBlockStore, events: Sequence[StoreEvent]) -> None:
    stats = store.stats()
    metrics.KVCACHE_BLOCKS.labels(tier=TIER).set(stats.num_blocks)
    metrics.KVCACHE_BYTES.labels(tier=TIER).set(stats.num_bytes)
    for event in events:
        if isinstance(event, BlocksRemoved):
            metrics.KVCACHE_EVICTIONS.labels(reason=event.reason).inc(len(event.block_hashes))


def count_lookup(num_asked: int, num_hits: int) -> None:
    metrics.KVCACHE_LOOKUPS.labels(outcome="hit").inc(num_hits)
    metrics.KVCACHE_LOOKUPS.labels(outcome="miss").inc(num_asked - num_hits)


async def abort(context: grpc.aio.ServicerContext, error: rpc.ServiceError) -> NoReturn:
    await rpc.abort_with(context, error)
    raise AssertionError("unreachable: abort raises") from error


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, store: HostBlockStore, lifecycle: Lifecycle, publisher: EventPublisher) -> None:
        self.store = store  # written only through this servicer
        self.lifecycle = lifecycle
        self.publisher = publisher

    async def Put(self, request_iterator: AsyncIterator[kvcache_pb2.Block],
                  context: grpc.aio.ServicerContext) -> kvcache_pb2.PutResponse:
        try:
            with self.lifecycle.track(), rpc.status_on_error():
                return await self._put(request_iterator)
        except rpc.ServiceError as error:
            await abort(context, error)

    async def _put(self, request_iterator: AsyncIterator[kvcache_pb2.Block]) -> kvcache_pb2.PutResponse:
        """Take every good block of the stream; if some were bad, say so after keeping the others."""
        blocks: list[Block] = []
        rejections: list[str] = []
        async for message in request_iterator:
            try:
                blocks.append(block_from_pb(message))
            except BlockError as exc:
                rejections.append(str(exc))
        result = self.store.put(blocks)
        export_metrics(self.store, result.events)
        await self.publisher.publish(result.events)
        rejections += result.rejections
        if rejections:
            raise BlockError(f"rejected {len(rejections)} block(s), stored {result.num_stored}, "
                             f"already present {result.num_present}: {'; '.join(rejections[:3])}")
        return kvcache_pb2.PutResponse(num_stored=result.num_stored, num_present=result.num_present)

    async def Get(self, request: kvcache_pb2.GetRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[kvcache_pb2.Block]:
        try:
            with self.lifecycle.track(), rpc.status_on_error():
                blocks = self.store.get(request.block_hashes, required_model(request.model))
                count_lookup(len(request.block_hashes), len(blocks))
                for block in blocks:
                    yield block_to_pb(block)
        except rpc.ServiceError as error:
            await abort(context, error)

    async def Lookup(self, request: kvcache_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> kvcache_pb2.LookupResponse:
        try:
            with self.lifecycle.track(), rpc.status_on_error():
                num_hits = self.store.lookup(request.block_hashes, required_model(request.model))
                count_lookup(len(request.block_hashes), num_hits)
                return kvcache_pb2.LookupResponse(num_hits=num_hits)
        except rpc.ServiceError as error:
            await abort(context, error)


async def serve(settings: KVCacheSettings) -> None:
    runtime = ServiceRuntime(settings, common_pb2.ROLE_KVCACHE)
    store = HostBlockStore(settings.capacity_bytes)
    publisher = EventPublisher(await runtime.connect_bus(), runtime.worker_id)
    servicer = KVCacheServicer(store, runtime.lifecycle, publisher)
    export_metrics(store, ())
    await runtime.start(register=lambda server: kvcache_pb2_grpc.add_KVCacheServicer_to_server(servicer, server),
                        load=lambda: common_pb2.WorkerLoad(num_cached_blocks=store.num_blocks))
    try:
        await runtime.wait_for_stop()
    finally:  # in-flight Puts finish (and publish their events) before the bus closes
        await runtime.shutdown()
