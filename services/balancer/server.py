"""The Balancer servicer and `serve()`: pools from heartbeats (WorkerRegistry), the KV index from every KV event
batch on the bus, the Router's picks, metrics.

Every balancer replica follows the same heartbeats and events, so replicas agree on pools and caches; each counts
only the requests it routed itself between two heartbeats.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc
import grpc.aio

from mesh import metrics, rpc, subjects
from mesh.discovery import KnownWorker, WorkerRegistry
from mesh.logging import get_logger
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2, events_pb2
from mesh.service import Lifecycle, ServiceRuntime
from services.balancer.config import BalancerSettings
from services.balancer.kv_index import KVIndex
from services.balancer.router import NoWorkerError, RouteRequest, Router, WorkerPair, WorkerState

POOL_ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}
log = get_logger(__name__)


def worker_state(worker: KnownWorker) -> WorkerState:
    info, load = worker.info, worker.load
    return WorkerState(worker_id=info.worker_id, heartbeat_ms=worker.last_seen_ms, block_size=info.block_size,
                       max_num_seqs=info.max_num_seqs, num_kv_blocks=info.num_kv_blocks,
                       num_running=load.num_running, num_queued_prompt_tokens=load.num_queued_prompt_tokens,
                       num_kv_tokens=load.num_kv_tokens)


def route_request_from_pb(request: balancer_pb2.RouteRequest) -> RouteRequest:
    if not request.model:
        raise ValueError("model is required")
    return RouteRequest(model=request.model, block_hashes=tuple(request.block_hashes),
                        num_prompt_tokens=request.num_prompt_tokens,
                        exclude_worker_ids=frozenset(request.exclude_worker_ids))


def apply_kv_batch(index: KVIndex, worker_id: str, batch: events_pb2.KVEventBatch) -> None:
    """The index's only writer apart from `drop`: one batch, its events in order."""
    num_missed = index.check_seq(worker_id, batch.seq)
    if num_missed:
        log.warning("KV event batches missed; the index may be stale until the worker's cache turns over",
                    worker_id=worker_id, seq=batch.seq, num_missed=num_missed)
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind == "stored":
            index.add(worker_id, event.stored.block_hashes)
        elif kind == "removed":
            index.remove(worker_id, event.removed.block_hashes)
        elif kind == "all_cleared" and event.all_cleared:
            index.clear(worker_id)


def export_pool_sizes(registry: WorkerRegistry) -> None:
    """BALANCER_WORKERS reads the registry at each scrape."""
    def num_workers(role: int) -> Callable[[], float]:
        return lambda: len(registry.workers(role))

    for pool, role in POOL_ROLES.items():
        metrics.BALANCER_WORKERS.labels(pool=pool).set_function(num_workers(role))


@contextlib.contextmanager
def status_codes() -> Iterator[None]:
    """The one place this service chooses status codes."""
    try:
        with rpc.status_on_error():
            yield
    except NoWorkerError as exc:
        raise rpc.ServiceError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc


async def abort(context: grpc.aio.ServicerContext, error: rpc.ServiceError) -> NoReturn:
    await rpc.abort_with(context, error)
    raise AssertionError("unreachable: abort raises") from error


class BalancerServicer(balancer_pb2_grpc.BalancerServicer):
    def __init__(self, registry: WorkerRegistry, router: Router, lifecycle: Lifecycle) -> None:
        self.registry = registry  # read only here
        self.router = router  # written only by Route (and the registry's leave callback)
        self.lifecycle = lifecycle

    async def Route(self, request: balancer_pb2.RouteRequest,
                    context: grpc.aio.ServicerContext) -> balancer_pb2.RouteResponse:
        try:
            with self.lifecycle.track(), status_codes():
                route = self._route(route_request_from_pb(request))
                return balancer_pb2.RouteResponse(prefill=self._info(route.prefill_worker_id),
                                                  decode=self._info(route.decode_worker_id),
                                                  num_cached_tokens=route.num_cached_tokens)
        except rpc.ServiceError as error:
            await abort(context, error)

    def _route(self, request: RouteRequest) -> WorkerPair:
        pools = {pool: [worker_state(w) for w in self.registry.workers(role, request.model)]
                 for pool, role in POOL_ROLES.items()}
        route = self.router.route(request, pools["prefill"], pools["decode"])
        metrics.BALANCER_ROUTES.labels(pool="prefill", worker=route.prefill_worker_id).inc()
        metrics.BALANCER_ROUTES.labels(pool="decode", worker=route.decode_worker_id).inc()
        return route

    def _info(self, worker_id: str) -> common_pb2.WorkerInfo:
        worker = self.registry.get(worker_id)
        assert worker is not None, "picked from the registry without yielding"
        return worker.info

    async def ListWorkers(self, request: balancer_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> balancer_pb2.ListWorkersResponse:
        statuses = [balancer_pb2.WorkerStatus(worker=w.info, load=w.load, last_seen_ms=w.last_seen_ms)
                    for w in self.registry.workers()]
        return balancer_pb2.ListWorkersResponse(workers=statuses)


async def serve(settings: BalancerSettings) -> None:
    runtime = ServiceRuntime(settings, common_pb2.ROLE_BALANCER)
    bus = await runtime.connect_bus()
    index = KVIndex()
    router = Router(index, settings.num_recent_routes)

    def on_leave(worker: KnownWorker) -> None:
        index.drop(worker.worker_id)
        router.forget(worker.worker_id)

    registry = WorkerRegistry(bus, POOL_ROLES.values(), settings.heartbeat_interval_s, on_leave=on_leave)

    async def on_kv_batch(batch: events_pb2.KVEventBatch, subject: str) -> None:
        worker_id = batch.worker_id or subject.removeprefix(subjects.KV_EVENTS_PREFIX + ".")
        worker = registry.get(worker_id)
        if worker is not None and worker.info.role == common_pb2.ROLE_PREFILL:  # only prefill caches steer routes
            apply_kv_batch(index, worker_id, batch)

    await registry.start()
    kv_subscription = await bus.subscribe(subjects.ALL_KV_EVENTS, events_pb2.KVEventBatch, on_kv_batch)
    export_pool_sizes(registry)
    servicer = BalancerServicer(registry, router, runtime.lifecycle)
    await runtime.start(register=lambda server: balancer_pb2_grpc.add_BalancerServicer_to_server(servicer, server),
                        load=common_pb2.WorkerLoad)

    async def stop_following() -> None:
        await kv_subscription.unsubscribe()
        await registry.stop()

    try:
        await runtime.wait_for_stop()
    finally:
        await runtime.shutdown(before_drain=stop_following)
