"""The Prefill servicer and `serve()`: protobuf <-> the Prefiller, status codes in one place, load and metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc
import grpc.aio

from mesh import lane, metrics, rpc, tracing
from mesh.compute.convert import (
    finish_reason_to_proto,
    image_from_proto,
    logprob_to_proto,
    sampling_from_proto,
    worker_load,
)
from mesh.compute.engines import ModelEngines
from mesh.compute.errors import abort, status_on_error
from mesh.compute.faults import Faults
from mesh.discovery import WorkerRegistry
from mesh.erasure import Protection
from mesh.logging import bind_request_id, get_logger
from mesh.outbox import export_metrics as export_outbox_metrics
from mesh.pb import common_pb2, prefill_pb2, prefill_pb2_grpc
from mesh.rpc import ServiceError
from mesh.service import Lifecycle, ServiceRuntime
from services.prefill.binder import BalancerBinder
from services.prefill.config import PrefillSettings
from services.prefill.decode_client import DecodePusher
from services.prefill.fetch_decision import FetchPlanner
from services.prefill.kv_events import KVEventRelay
from services.prefill.prefiller import BindError, Prefiller, PrefillJob, PrefillResult, PushError
from services.prefill.store_client import StoreClient, StoreWriter

log = get_logger(__name__)


def job_from_proto(r: prefill_pb2.PrefillRequest) -> PrefillJob:
    """Raises ValueError (INVALID_ARGUMENT) for a request that cannot be served as sent."""
    if not r.request_id:
        raise ValueError("request_id is required")
    return PrefillJob(
        request_id=r.request_id,
        model=r.model,
        prompt_token_ids=list(r.prompt_token_ids),
        params=sampling_from_proto(r.sampling),
        cache_salt=r.cache_salt or None,
        decode_address=r.decode_address,
        decode_worker_id=r.decode_worker_id,
        decode_data_address=r.decode_data_address,
        traffic_class=r.traffic_class,
        images=tuple(image_from_proto(i) for i in r.images),
        output_token_ids=tuple(r.output_token_ids),
        exclude_decode_worker_ids=tuple(r.exclude_decode_worker_ids),
        canary=r.canary,
    )


def response_to_proto(result: PrefillResult, worker_id: str) -> prefill_pb2.PrefillResponse:
    response = prefill_pb2.PrefillResponse(
        worker_id=worker_id,
        first_token_id=result.first_token_id,
        finish_reason=finish_reason_to_proto(result.finish_reason),
        num_prompt_tokens=result.num_prompt_tokens,
        num_cached_tokens=result.num_cached_tokens,
        num_store_tokens=result.num_store_tokens,
        prefill_seconds=result.prefill_seconds,
        kv_bytes_sent=result.kv_bytes_sent,
    )
    if result.decode is not None:  # late binding: where the gateway attaches
        response.decode_worker_id = result.decode.worker_id
        response.decode_address = result.decode.address
    if result.first_logprob is not None:
        response.first_logprob.CopyFrom(logprob_to_proto(result.first_logprob))
    return response


@contextlib.contextmanager
def prefill_status_on_error() -> Iterator[None]:
    """The compute roles' mapping, plus a failed push: its code, and the decode worker to route around; and a
    failed late binding (no balancer named a decode worker): UNAVAILABLE."""
    try:
        with status_on_error():
            yield
    except BindError as exc:
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
    except PushError as exc:
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.is_exhausted else grpc.StatusCode.UNAVAILABLE
        raise ServiceError(code, str(exc), ((rpc.FAILED_WORKER_KEY, exc.decode_worker_id),)) from exc


def export_metrics(model: str, result: PrefillResult) -> None:
    metrics.PREFILL_PROMPT_TOKENS.labels(model=model).inc(result.num_prompt_tokens)
    metrics.PREFILL_CACHED_TOKENS.labels(model=model, tier="device").inc(
        result.num_cached_tokens - result.num_store_tokens
    )
    metrics.PREFILL_CACHED_TOKENS.labels(model=model, tier="store").inc(result.num_store_tokens)
    metrics.PREFILL_SECONDS.labels(model=model).observe(result.prefill_seconds)
    metrics.REQUEST_QUEUE_TIME.labels(model_name=model).observe(result.queue_seconds)
    metrics.KV_TRANSFER_BYTES.labels(direction="prefill_to_decode").inc(result.kv_bytes_sent)
    if result.fetch is not None:
        metrics.PREFILL_KV_FETCH_DECISIONS.labels(choice=result.fetch.choice).inc()
        metrics.PREFILL_KV_FETCH_SAVED_SECONDS.inc(
            max(result.fetch.predicted_recompute_s - result.fetch.predicted_s, 0)
        )
        metrics.PREFILL_STORE_READ_BYTES_PER_SECOND.set(result.fetch.store_bytes_per_s)
        metrics.PREFILL_COMPUTE_TOKENS_PER_SECOND.set(result.fetch.compute_tokens_per_s)
    span = tracing.current_span()
    if span.is_recording():
        span.set_attributes(
            {
                tracing.GEN_AI_MODEL: model,
                tracing.GEN_AI_INPUT_TOKENS: result.num_prompt_tokens,
                f"{tracing.CACHED_TOKENS}.device": result.num_cached_tokens - result.num_store_tokens,
                f"{tracing.CACHED_TOKENS}.store": result.num_store_tokens,
                tracing.BYTES_MOVED: result.kv_bytes_sent,
            }
        )


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self, prefiller: Prefiller, lifecycle: Lifecycle, worker_id: str, faults: Faults | None = None
    ) -> None:
        self.prefiller = prefiller
        self.lifecycle = lifecycle
        self.worker_id = worker_id
        self.faults = faults or Faults()  # testing only (KVMESH_ALLOW_FAULT_INJECTION)

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        with bind_request_id(request.request_id or rpc.request_id_of(context)):
            try:
                with self.lifecycle.track(), prefill_status_on_error():
                    self.faults.check()
                    result = await self.prefiller.prefill(job_from_proto(request))
                    await self.faults.delay(1)
            except ServiceError as error:
                await abort(context, error)
        export_metrics(request.model, result)
        return response_to_proto(result, self.worker_id)

    async def PrefillStream(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        """Prefill, answered as soon as the first token is known, then again when decode holds the KV."""
        with bind_request_id(request.request_id or rpc.request_id_of(context)):
            try:
                with self.lifecycle.track(), prefill_status_on_error():
                    self.faults.check()
                    first: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
                    work = asyncio.ensure_future(
                        self.prefiller.prefill(job_from_proto(request), on_first=first.set_result)
                    )
                    try:
                        await asyncio.wait((first, work), return_when=asyncio.FIRST_COMPLETED)
                        if first.done():
                            await self.faults.delay(1)
                            response = response_to_proto(first.result(), self.worker_id)
                            response.kv_pending = not work.done()
                            yield response
                        result = await work
                    finally:
                        work.cancel()  # the caller left: stop computing or pushing (a no-op once done)
            except ServiceError as error:
                await abort(context, error)
                return
        export_metrics(request.model, result)
        yield prefill_pb2.PrefillResponse(worker_id=self.worker_id, kv_bytes_sent=result.kv_bytes_sent)


class PrefillService:
    """A running prefill worker: engines, the Prefiller with its decode and store clients, the KV event relay,
    the servicer and the runtime, started and stopped together."""

    def __init__(
        self,
        settings: PrefillSettings,
        runtime: ServiceRuntime,
        registry: WorkerRegistry | None,
        writer: StoreWriter | None,
        relay: KVEventRelay,
        balancers: WorkerRegistry,
    ) -> None:
        self.settings = settings
        self.runtime = runtime
        self.registry = registry
        self.balancers = balancers  # late binding asks them for a decode worker
        self.writer = writer
        self.relay = relay
        self.store: StoreClient | None = None
        self.engines: ModelEngines | None = None
        self.pusher: DecodePusher | None = None
        self.prefiller: Prefiller | None = None

    @classmethod
    async def start(cls, settings: PrefillSettings) -> PrefillService:
        runtime = ServiceRuntime(settings, common_pb2.ROLE_PREFILL)  # first: it configures logging
        bus = await runtime.connect_bus()
        registry = store = writer = None
        if settings.kvcache_enabled:
            registry = WorkerRegistry(bus, [common_pb2.ROLE_KVCACHE], settings.heartbeat_interval_s)
            await registry.start()
            store = StoreClient(
                registry,
                runtime.channels,
                protection=Protection.parse(settings.kv_protection),
                use_index=settings.kv_index_enabled,
                stream_layers=settings.kv_stream_layers,
                use_lanes=settings.kv_store_lanes,
                lane_tls=lane.client_tls(runtime.credentials),
                priced=settings.priced_protection(),
            )
            await store.start(bus)
            writer = StoreWriter(store, settings.store_write_queue_bytes)
            writer.start()
        relay = KVEventRelay(runtime.worker_id, bus, writer, settings.outbox_size)
        relay.start()
        export_outbox_metrics("kv_events", relay.outbox)
        balancers = WorkerRegistry(bus, [common_pb2.ROLE_BALANCER], settings.heartbeat_interval_s)
        service = cls(settings, runtime, registry, writer, relay, balancers)
        service.store = store
        try:
            await balancers.start()
            service.engines = engines = await ModelEngines.load(settings, relay.hook)
            service.pusher = DecodePusher(
                runtime.channels, use_lanes=settings.kv_push_lanes, lane_tls=lane.client_tls(runtime.credentials)
            )
            prefiller = Prefiller(
                engines,
                service.pusher,
                store,
                relay.note_injected,
                max_chunk_bytes=rpc.KV_CHUNK_BYTES,
                critical=writer.defer_while if writer is not None else contextlib.nullcontext,
                planner=FetchPlanner(settings.kv_fetch),
                binder=BalancerBinder(balancers, runtime.channels),
            )
            service.prefiller = prefiller
            servicer = PrefillServicer(prefiller, runtime.lifecycle, runtime.worker_id, settings.faults())
            await runtime.start(
                register=lambda server: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server),
                load=lambda: worker_load(engines.stats().values(), relay.num_cached_blocks),
                models=engines.models,
                max_num_seqs=settings.max_num_seqs,
                num_kv_blocks=engines.num_kv_blocks,
                block_size=settings.block_size,
                model_block_sizes=engines.block_sizes,
            )
            await engines.start_expert_sync(runtime.bus, runtime.worker_id, settings.expert_report_steps)
        except BaseException:
            await service.stop()
            raise
        return service

    async def stop(self) -> None:
        """Leave the pool, finish in-flight requests, write what the store still lacks, then close."""

        async def finish_work() -> None:
            await self.runtime.lifecycle.drain(self.settings.drain_timeout_s)
            if self.writer is not None and not await self.writer.flush(self.settings.drain_timeout_s):
                log.warning("KV store writes still queued at shutdown were dropped")

        await self.runtime.shutdown(before_drain=finish_work)
        if self.engines is not None:
            await self.engines.stop()
        if self.pusher is not None:
            self.pusher.close()
        await self.relay.stop()
        if self.writer is not None:
            await self.writer.stop()
        if self.store is not None:
            await self.store.stop()
        for registry in (self.registry, self.balancers):
            if registry is not None:
                with contextlib.suppress(Exception):  # the bus is closed by now
                    await registry.stop()


async def serve(settings: PrefillSettings) -> None:
    service = await PrefillService.start(settings)
    try:
        await service.runtime.wait_for_stop()
    finally:
        await service.stop()
