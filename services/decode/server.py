"""The Decode servicer and `serve()`: protobuf <-> the Decoder, status codes in one place, load and metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from engine_core import EngineStats
from engine_core.kv_transfer import KVChunk
from mesh import metrics, rpc, subjects, tracing
from mesh.bus import Bus
from mesh.compute.convert import finish_reason_to_proto, logprob_to_proto, worker_load
from mesh.compute.engines import ModelEngines
from mesh.compute.errors import abort, status_on_error
from mesh.discovery import now_ms
from mesh.lane import server_tls
from mesh.logging import REQUEST_ID_KEY, bind_request_id, get_logger
from mesh.outbox import Envelope, Outbox
from mesh.outbox import export_metrics as export_outbox_metrics
from mesh.pb import common_pb2, decode_pb2, decode_pb2_grpc, events_pb2
from mesh.rpc import ServiceError
from mesh.service import Lifecycle, ServiceRuntime
from services.decode.config import DecodeSettings
from services.decode.decoder import Decoder, LeftRequest, PushHeader, TokenBatch
from services.decode.lane import PREFILL_TO_DECODE, PushLane, header_from_proto

log = get_logger(__name__)


def token_batch_to_proto(batch: TokenBatch) -> decode_pb2.TokenBatch:
    return decode_pb2.TokenBatch(
        token_ids=batch.token_ids,
        logprobs=[logprob_to_proto(lp) for lp in batch.logprobs],
        finish_reason=finish_reason_to_proto(batch.finish_reason),
        num_output_tokens=batch.num_output_tokens,
    )


async def read_header(messages: AsyncIterator[decode_pb2.KVPushMessage]) -> PushHeader:
    first = await anext(messages, None)
    if first is None or first.WhichOneof("kind") != "header":
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "a KV push must start with its header")
    return header_from_proto(first.header)


async def read_chunks(messages: AsyncIterator[decode_pb2.KVPushMessage]) -> AsyncIterator[KVChunk]:
    async for message in messages:
        if message.WhichOneof("kind") != "chunk":
            raise ValueError("a KV push has exactly one header, and it comes first")
        chunk = message.chunk
        yield KVChunk(chunk.layer, chunk.first_block, chunk.num_blocks, chunk.data)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, decoder: Decoder, lifecycle: Lifecycle, worker_id: str) -> None:
        self.decoder = decoder
        self.lifecycle = lifecycle
        self.worker_id = worker_id

    async def PushKV(
        self, request_iterator: AsyncIterator[decode_pb2.KVPushMessage], context: grpc.aio.ServicerContext
    ) -> decode_pb2.PushKVResponse:
        messages = aiter(request_iterator)
        try:
            with self.lifecycle.track(), status_on_error():
                header = await read_header(messages)
                with bind_request_id(header.request_id):
                    num_bytes = await self.decoder.receive(
                        header,
                        read_chunks(messages),
                        on_reserved=lambda: context.send_initial_metadata(((rpc.KV_RESERVED_KEY, "1"),)),
                    )
        except ServiceError as error:
            await abort(context, error)
        metrics.KV_TRANSFER_BYTES.labels(direction=PREFILL_TO_DECODE).inc(num_bytes)
        tracing.current_span().set_attribute(tracing.BYTES_MOVED, num_bytes)
        return decode_pb2.PushKVResponse(worker_id=self.worker_id, num_bytes=num_bytes)

    async def Stream(
        self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.TokenBatch]:
        with bind_request_id(request.request_id):
            span = tracing.current_span()
            last: TokenBatch | None = None
            try:
                with self.lifecycle.track(), status_on_error():
                    async for batch in self.decoder.follow(request.request_id):
                        trace_batch(span, batch, is_first=last is None)
                        last = batch
                        yield token_batch_to_proto(batch)
            except ServiceError as error:
                await abort(context, error)
            finally:
                trace_end(span, last)

    async def Abort(
        self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.AbortResponse:
        # not tracked: aborting must work while draining too (it only shortens the drain)
        with bind_request_id(request.request_id):
            return decode_pb2.AbortResponse(aborted=await self.decoder.abort(request.request_id))


def trace_batch(span: tracing.Span, batch: TokenBatch, is_first: bool) -> None:
    """The stream's span: an event at its first tokens. Nothing per later batch: attributes cost CPU on the
    token path, so the count and finish reason go on once, at the end (`trace_end`)."""
    if is_first and span.is_recording():
        span.add_event("first token", {"kvmesh.num_tokens": len(batch.token_ids)})
    if batch.finish_reason is not None:  # the last: set before it goes out, as the caller may end the call at once
        trace_end(span, batch)


def trace_end(span: tracing.Span, last: TokenBatch | None) -> None:
    """The stream's span as it ends (finished, cut or failed): the output tokens so far, the finish reason if any."""
    if last is None or not span.is_recording():
        return
    attributes: dict[str, int | list[str]] = {tracing.GEN_AI_OUTPUT_TOKENS: last.num_output_tokens}
    if last.finish_reason is not None:
        attributes[tracing.GEN_AI_FINISH_REASONS] = [last.finish_reason]
    span.set_attributes(attributes)


def export_metrics(stats: dict[str, EngineStats]) -> None:
    for model, s in stats.items():
        metrics.DECODE_RUNNING.labels(model=model).set(s.num_running)
        metrics.KV_CACHE_USAGE.labels(model_name=model).set(s.kv_usage)
        metrics.NUM_REQUESTS_RUNNING.labels(model_name=model).set(s.num_running)
        metrics.NUM_REQUESTS_WAITING.labels(model_name=model).set(s.num_waiting)
        metrics.DECODE_KV_TOKENS.labels(model=model).set(s.num_kv_tokens)
        metrics.DECODE_PROMPT_TOKENS_COMPUTED.labels(model=model).set(s.num_prompt_tokens_computed)


async def export_metrics_forever(engines: ModelEngines, interval_s: float) -> None:
    while True:
        export_metrics(engines.stats())
        await asyncio.sleep(interval_s)


class FinishedFeed:
    """Requests leaving this worker (kvmesh.requests.finished), through an outbox (mesh.outbox): balancers count a
    request's KV as free at once, and the gateways' KVMESH_FINISHED keeps each one, from which a request whose
    gateway died is billed, so none may be lost while NATS is away. Each is a JetStream publish, acknowledged, with
    the id `<worker>.<start ms>.<seq>` (a copy sent again after a lost ack is kept once); a core publish while no
    gateway has made the stream yet. Only `publish` (the event loop) writes `seq`."""

    def __init__(self, bus: Bus, worker_id: str, capacity: int) -> None:
        self.worker_id = worker_id
        self.seq = 0
        self._epoch = now_ms()
        self.outbox = Outbox(bus, capacity, stream=subjects.FINISHED_STREAM)

    def publish(self, message: events_pb2.RequestFinished) -> None:
        self.seq += 1
        msg_id = f"{self.worker_id}.{self._epoch}.{self.seq}"
        headers = {REQUEST_ID_KEY: message.request_id, **tracing.headers()}  # the request's trace, as bus.publish
        self.outbox.put(Envelope(subjects.REQUESTS_FINISHED, message.SerializeToString(), msg_id, headers))


class DecodeService:
    """A running decode worker: its engines, the Decoder, the servicer and the runtime, started and stopped together."""

    def __init__(self, settings: DecodeSettings, runtime: ServiceRuntime, engines: ModelEngines) -> None:
        self.settings = settings
        self.runtime = runtime
        self.engines = engines
        self.decoder = Decoder(
            engines, settings.stream_attach_timeout_s, on_left=self._announce_left, faults=settings.faults()
        )
        self.lane: PushLane | None = None  # the bulk lane prefill pushes KV over (KVMESH_DATA_PORT)
        self.finished: FinishedFeed | None = None  # made once the bus is connected
        self._exporter = asyncio.create_task(export_metrics_forever(engines, settings.heartbeat_interval_s))

    @classmethod
    async def start(cls, settings: DecodeSettings) -> DecodeService:
        runtime = ServiceRuntime(settings, common_pb2.ROLE_DECODE)  # first: it configures logging
        engines = await ModelEngines.load(settings)
        service = cls(settings, runtime, engines)
        servicer = DecodeServicer(service.decoder, runtime.lifecycle, runtime.worker_id)
        try:
            bus = await runtime.connect_bus()  # before the first request can finish
            service.finished = FinishedFeed(bus, runtime.worker_id, settings.outbox_size)
            service.finished.outbox.start()
            export_outbox_metrics("finished_requests", service.finished.outbox)
            data_port = 0
            if settings.data_port >= 0:
                service.lane = PushLane(
                    service.decoder, runtime.lifecycle, runtime.worker_id, settings, server_tls(runtime.credentials)
                )
                data_port = await service.lane.start(settings.host, settings.data_port)
            await runtime.start(
                register=lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server),
                load=lambda: worker_load(engines.stats().values()),
                models=engines.models,
                max_num_seqs=settings.max_num_seqs,
                num_kv_blocks=engines.num_kv_blocks,
                block_size=settings.block_size,
                model_block_sizes=engines.block_sizes,
                data_port=data_port,
            )
            await engines.start_expert_sync(runtime.bus, runtime.worker_id, settings.expert_report_steps)
        except BaseException:
            await service.stop()
            raise
        return service

    def _announce_left(self, left: LeftRequest) -> None:
        """The finished-request feed: balancers count the request's KV as free now, not at the next heartbeat."""
        if self.finished is None:
            return
        message = events_pb2.RequestFinished(
            request_id=left.request_id,
            worker_id=self.runtime.worker_id,
            model=left.model,
            num_kv_tokens=left.num_kv_tokens,
            num_output_tokens=left.num_output_tokens,
            finish_reason=left.finish_reason,
            timestamp_ms=now_ms(),
        )
        self.finished.publish(message)

    async def _stop_finished(self) -> None:
        if self.finished is not None:
            await self.finished.outbox.stop()

    async def stop(self) -> None:
        """Leave the pool, let followed requests finish (up to drain_timeout_s), send what they published, then
        close."""
        await self.runtime.shutdown(after_drain=self._stop_finished)
        if self.lane is not None:
            await self.lane.stop()
        self.decoder.close()
        self._exporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._exporter
        await self.engines.stop()


async def serve(settings: DecodeSettings) -> None:
    service = await DecodeService.start(settings)
    try:
        await service.runtime.wait_for_stop()
    finally:
        await service.stop()
