"""The KVCache servicer and `serve()`: protobuf <-> store values, KV events on JetStream, TTLs, repair, metrics.

The store's changes are published as KVEventBatch, one batch per tier ("host", "ssd"), on kvmesh.kv.<worker_id>
(kept by the JetStream stream KVMESH_KV), numbered by `seq`. A handler changes the store and asks for the publish
without yielding in between, and the outbox sends them in that order, so batches leave in the order the changes
happened (NATS away: when it returns; the outbox overflowed: the node's whole state instead). At start the node
says `all_cleared`, then announces what its SSD directory still holds.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import NoReturn

import grpc.aio

from mesh import metrics, rpc, subjects, tracing
from mesh.bus import Bus
from mesh.discovery import WorkerRegistry, now_ms
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import KVEventFollower, ensure_kv_stream
from mesh.lane import server_tls
from mesh.logging import get_logger
from mesh.outbox import Envelope, Outbox
from mesh.outbox import export_metrics as export_outbox_metrics
from mesh.pb import common_pb2, events_pb2, kvcache_pb2, kvcache_pb2_grpc
from mesh.service import Lifecycle, ServiceRuntime
from services.kvcache.blocks import BlocksRemoved, BlocksStored, StoreEvent, layer_major_slices
from services.kvcache.codec import block_from_pb, block_to_pb
from services.kvcache.config import KVCacheSettings
from services.kvcache.lane import LaneServer
from services.kvcache.repair import Repairer
from services.kvcache.store import Block, BlockError, BlockStore

__all__ = ["KVCacheServicer", "serve"]
log = get_logger(__name__)


def required_model(model: str) -> str:
    if not model:
        raise ValueError("model is required (a block of another model never matches)")
    return model


def event_to_pb(event: StoreEvent) -> events_pb2.KVEvent:
    if isinstance(event, BlocksStored):
        return events_pb2.KVEvent(
            stored=events_pb2.KVBlocksStored(
                block_hashes=event.block_hashes,
                parent_hash=event.parent_hash,
                block_size=event.block_size,
                model=event.model,
                fragment_indices=event.fragment_indices,
                num_data_fragments=event.num_data_fragments if event.fragment_indices else 0,
                num_fragments=event.num_fragments if event.fragment_indices else 0,
            )
        )
    return events_pb2.KVEvent(
        removed=events_pb2.KVBlocksRemoved(block_hashes=event.block_hashes, model=event.model, reason=event.reason)
    )


class EventPublisher:
    """This node's KV event stream, through an outbox (mesh.outbox): a Put never waits on NATS, and what happens
    while NATS is away is sent, in order and acknowledged, when it returns. When the outbox overflows, the node
    sends its whole state instead (`all_cleared`, then every block it holds: `holdings`). Only `_batch` writes
    `seq`, so numbers follow call order; ids `<worker>.<start ms>.<seq>` let the stream drop a resent copy."""

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        jetstream: bool = True,
        capacity: int = 10_000,
        holdings: Callable[[], list[StoreEvent]] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.jetstream = jetstream  # False: NATS has no JetStream, plain publishes only
        self.seq = 0
        self.holdings = holdings
        self._epoch = now_ms()
        resync = self._resync if holdings is not None else None
        self.outbox = Outbox(bus, capacity, jetstream=jetstream, resync=resync)

    def start(self) -> None:
        self.outbox.start()

    async def stop(self, timeout_s: float = 5.0) -> None:
        await self.outbox.stop(timeout_s)

    def publish(self, events: Sequence[StoreEvent]) -> None:
        """Consecutive events of one tier go out as one batch."""
        for tier, run in _runs_by_tier(events):
            self.outbox.put(self._batch(tier, [event_to_pb(e) for e in run]))

    def clear_all(self) -> None:
        self.outbox.put(self._batch("", [events_pb2.KVEvent(all_cleared=True)]))

    def _resync(self) -> list[Envelope]:
        assert self.holdings is not None
        envelopes = [self._batch("", [events_pb2.KVEvent(all_cleared=True)])]
        for tier, run in _runs_by_tier(self.holdings()):
            envelopes.append(self._batch(tier, [event_to_pb(e) for e in run]))
        return envelopes

    def _batch(self, tier: str, events: list[events_pb2.KVEvent]) -> Envelope:
        self.seq += 1
        batch = events_pb2.KVEventBatch(worker_id=self.worker_id, seq=self.seq, tier=tier, events=events)
        subject = subjects.kv_events(self.worker_id)
        return Envelope(subject, batch.SerializeToString(), f"{self.worker_id}.{self._epoch}.{self.seq}")


def _runs_by_tier(events: Sequence[StoreEvent]) -> list[tuple[str, list[StoreEvent]]]:
    runs: list[tuple[str, list[StoreEvent]]] = []
    for event in events:
        if runs and runs[-1][0] == event.tier:
            runs[-1][1].append(event)
        else:
            runs.append((event.tier, [event]))
    return runs


def export_metrics(store: BlockStore, events: Sequence[StoreEvent]) -> None:
    for name, tier in store.stats().tiers.items():
        metrics.KVCACHE_BLOCKS.labels(tier=name).set(tier.num_blocks)
        metrics.KVCACHE_BYTES.labels(tier=name).set(tier.num_bytes)
    for event in events:
        if isinstance(event, BlocksRemoved):
            metrics.KVCACHE_EVICTIONS.labels(reason=event.reason).inc(len(event.block_hashes))


CHUNK_BYTES = 2**20  # grpc-python moves ~1 MiB messages fastest (kvmesh bench kv-transfer --explore)


def layer_major_chunks(datas: Sequence[bytes], slice_bytes: int) -> Iterator[kvcache_pb2.Block]:
    """The slices as Get streams them: one Block per chunk of about CHUNK_BYTES, its pieces joined into `data`."""
    for offset, first, parts in layer_major_slices(datas, slice_bytes, CHUNK_BYTES):
        yield kvcache_pb2.Block(offset=offset, first_block=first, data=b"".join(parts))


def trace_read(num_asked: int, blocks: Sequence[tuple[Block, str]]) -> None:
    """The read's span (gRPC or lane): blocks asked, found per tier, bytes sent."""
    span = tracing.current_span()
    if not span.is_recording():
        return
    attributes = {f"kvmesh.kv.num_blocks.{tier}": count for tier, count in Counter(t for _, t in blocks).items()}
    attributes["kvmesh.kv.num_blocks_asked"] = num_asked
    attributes[tracing.BYTES_MOVED] = sum(len(block.data) for block, _ in blocks)
    span.set_attributes(attributes)  # one call: each takes the span's lock and checks every value


def count_lookup(num_asked: int, num_hits: int) -> None:
    metrics.KVCACHE_LOOKUPS.labels(outcome="hit").inc(num_hits)
    metrics.KVCACHE_LOOKUPS.labels(outcome="miss").inc(num_asked - num_hits)


async def abort(context: grpc.aio.ServicerContext, error: rpc.ServiceError) -> NoReturn:
    await rpc.abort_with(context, error)
    raise AssertionError("unreachable: abort raises") from error


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, store: BlockStore, lifecycle: Lifecycle, publisher: EventPublisher) -> None:
        self.store = store  # written only through this servicer (and its expire loop, on the same event loop)
        self.lifecycle = lifecycle
        self.publisher = publisher

    async def changed(self, events: Sequence[StoreEvent]) -> None:
        export_metrics(self.store, events)
        if events:
            self.publisher.publish(events)

    async def Put(
        self, request_iterator: AsyncIterator[kvcache_pb2.Block], context: grpc.aio.ServicerContext
    ) -> kvcache_pb2.PutResponse:
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
        return await self.write(blocks, rejections)

    async def write(self, blocks: list[Block], rejections: list[str]) -> kvcache_pb2.PutResponse:
        """Store the good blocks of a Put (or a write on the bulk lane); BlockError naming the bad ones after."""
        result = self.store.put(blocks)
        metrics.KV_TRANSFER_BYTES.labels(direction="store_in").inc(sum(len(b.data) for b in blocks))
        await self.changed(result.events)
        rejections += result.rejections
        if rejections:
            raise BlockError(
                f"rejected {len(rejections)} block(s), stored {result.num_stored}, "
                f"already present {result.num_present}: {'; '.join(rejections[:3])}"
            )
        return kvcache_pb2.PutResponse(num_stored=result.num_stored, num_present=result.num_present)

    async def Get(
        self, request: kvcache_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvcache_pb2.Block]:
        try:
            with self.lifecycle.track(), rpc.status_on_error():
                blocks = await self.read(request)
                for block, tier in blocks:
                    yield block_to_pb(block.without_data() if request.slice_bytes else block, tier)
                for chunk in layer_major_chunks([b.data for b, _ in blocks], request.slice_bytes):
                    yield chunk
        except rpc.ServiceError as error:
            await abort(context, error)

    async def read(self, request: kvcache_pb2.GetRequest) -> list[tuple[Block, str]]:
        """The held blocks a Get (or a read on the bulk lane) asks for, with their tiers; counted and announced."""
        if request.slice_bytes < 0:
            raise ValueError("slice_bytes must not be negative")
        result = self.store.get(request.block_hashes, required_model(request.model), request.skip_missing)
        count_lookup(len(request.block_hashes), len(result.blocks))
        await self.changed(result.events)
        for block, tier in result.blocks:
            metrics.KVCACHE_HIT_TOKENS.labels(tier=tier).inc(block.layout.block_size)
            metrics.KV_TRANSFER_BYTES.labels(direction="store_out").inc(len(block.data))
        trace_read(len(request.block_hashes), result.blocks)
        return result.blocks

    async def Lookup(
        self, request: kvcache_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvcache_pb2.LookupResponse:
        try:
            with self.lifecycle.track(), rpc.status_on_error():
                model = required_model(request.model)
                if request.per_block:
                    indices = self.store.fragment_indices(request.block_hashes, model)
                    num_hits = next((n for n, i in enumerate(indices) if i < 0), len(indices))
                    return kvcache_pb2.LookupResponse(num_hits=num_hits, fragment_indices=indices)
                num_hits = self.store.lookup(request.block_hashes, model)
                count_lookup(len(request.block_hashes), num_hits)
                return kvcache_pb2.LookupResponse(num_hits=num_hits)
        except rpc.ServiceError as error:
            await abort(context, error)

    async def Pin(self, request: kvcache_pb2.PinRequest, context: grpc.aio.ServicerContext) -> kvcache_pb2.PinResponse:
        try:
            with self.lifecycle.track(), rpc.status_on_error():
                if request.ttl_seconds < 0:
                    raise ValueError("ttl_seconds must not be negative")
                num_pinned = self.store.pin(request.block_hashes, required_model(request.model), request.ttl_seconds)
                metrics.KVCACHE_PINNED_BLOCKS.set(self.store.stats().num_pinned)
                return kvcache_pb2.PinResponse(num_pinned=num_pinned)
        except rpc.ServiceError as error:
            await abort(context, error)

    async def expire_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.changed(self.store.expire())
            metrics.KVCACHE_PINNED_BLOCKS.set(self.store.stats().num_pinned)


async def serve(settings: KVCacheSettings) -> None:
    runtime = ServiceRuntime(settings, common_pb2.ROLE_KVCACHE)
    store = BlockStore(settings.store_config(runtime.worker_id))
    bus = await runtime.connect_bus()
    publisher = EventPublisher(
        bus,
        runtime.worker_id,
        jetstream=await ensure_kv_stream(bus),
        capacity=settings.outbox_size,
        holdings=store.holdings,
    )
    publisher.start()
    export_outbox_metrics("kv_events", publisher.outbox)
    servicer = KVCacheServicer(store, runtime.lifecycle, publisher)
    publisher.clear_all()  # whatever an earlier process under this id announced is gone, except ...
    await servicer.changed(store.recover())  # ... what its SSD directory still holds
    registry = WorkerRegistry(bus, [common_pb2.ROLE_KVCACHE], settings.heartbeat_interval_s)
    index = GlobalKVIndex()
    follower = KVEventFollower(bus, index, tiers=frozenset({"host", "ssd"}), create=False)  # reads the snapshots
    repairer = Repairer(runtime.worker_id, store, index, registry, runtime.channels, settings.repair_delay_s)
    await registry.start()
    try:
        await follower.start()
    except RuntimeError:  # no JetStream: no global index here, so no repair (the node still serves)
        log.warning("no KV event stream: repair is off on this node")
    lane = LaneServer(servicer, settings, server_tls(runtime.credentials))
    data_port = await lane.start(settings.host, settings.data_port) if settings.data_port >= 0 else 0
    await runtime.start(
        register=lambda server: kvcache_pb2_grpc.add_KVCacheServicer_to_server(servicer, server),
        load=lambda: common_pb2.WorkerLoad(num_cached_blocks=store.num_blocks),
        data_port=data_port,
    )
    tasks = [asyncio.create_task(servicer.expire_forever(settings.expire_interval_s))]
    if publisher.jetstream:
        tasks.append(asyncio.create_task(repairer.run_forever(settings.repair_interval_s, follower)))
    try:
        await runtime.wait_for_stop()
    finally:  # in-flight Puts finish (and publish their events) before the bus closes
        for task in tasks:
            task.cancel()
        await follower.stop()
        await registry.stop()
        await runtime.shutdown(after_drain=publisher.stop)  # in-flight Puts' events go out before the bus closes
        await lane.stop()
