"""The Balancer servicer and `serve()`: pools from heartbeats (WorkerRegistry), the global KV index from the
KVMESH_KV stream (KVEventFollower: every tier of every worker, replayed at start), the routing policy's picks
(`mesh.routing.Router`, chosen by KVMESH_BALANCER_POLICY), decisions shared with peer replicas, recommended pool
sizes, metrics. Conversions between protobuf and the routing library's dataclasses happen here only.

Late binding (KVMESH_BALANCER_DECODE_BINDING=late, the default): Route names the prefill worker only, and the
prefill worker asks BindDecode for a decode worker once the request's KV is ready (its first token sampled); the
router's decode policy chooses then, with what it knows of the decode pool at that moment (docs/balancer.md).

Replicas: each publishes every decision on kvmesh.balancer.assign and counts its peers' (until the workers' next
heartbeats include them), so several balancers behind the gateways do not all pick the same idle worker. Each
publishes its recommended pool sizes on kvmesh.balancer.replicas once per heartbeat interval (and answers them in
ListWorkers). Decode workers announce every request that leaves them on kvmesh.requests.finished: its KV stops
counting at once (not at the worker's next heartbeat) and its output length teaches the decode policy. Canary
rollouts (mesh.rollouts, JetStream KV) split each model's conversations between its stable and canary workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc
import grpc.aio

from mesh import metrics, rpc, subjects
from mesh.bus import Bus
from mesh.discovery import KnownWorker, WorkerRegistry, model_block_size, now_ms
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import KVEventFollower, KVIndexCompactor
from mesh.logging import get_logger
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2, events_pb2
from mesh.rollouts import RolloutStore, splits
from mesh.routing import Assignment, CostModel, NoWorkerError, Router, RouteRequest, WorkerState
from mesh.routing import Route as Picked  # `Route` is the servicer's method
from mesh.routing.capacity import CapacityPlanner, PoolRecommendation
from mesh.routing.encoder import EncoderBalancer
from mesh.service import Lifecycle, ServiceRuntime
from services.balancer.config import BalancerSettings
from services.balancer.rollouts import ROLLOUT_TICK_S, RolloutController

# the pools the capacity planner sizes (routing reads prefill and decode; the encoder pool is sized for its
# autoscaler: deploy/kubernetes/autoscaling/)
POOL_ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE, "encoder": common_pb2.ROLE_ENCODER}
MAX_SHARED_BLOCKS = 4096  # block keys an Assignment carries (the uncached suffix's first ones)
log = get_logger(__name__)


# -- conversions ----------------------------------------------------------------------------------------------------
def worker_state(worker: KnownWorker, model: str | None = None) -> WorkerState:
    """`model`: the pool's model, whose block size (the worker's engine's for it) its token figures use."""
    info, load = worker.info, worker.load
    return WorkerState(
        worker_id=info.worker_id,
        reported_s=worker.last_seen_ms / 1000.0,
        block_size=info.block_size if model is None else model_block_size(info, model),
        max_num_seqs=info.max_num_seqs,
        num_kv_blocks=info.num_kv_blocks,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_queued_prompt_tokens=load.num_queued_prompt_tokens,
        num_kv_tokens=load.num_kv_tokens,
        kv_usage=load.kv_usage,
        num_cached_blocks=load.num_cached_blocks,
        version=info.version,
    )


def route_request_from_pb(request: balancer_pb2.RouteRequest) -> RouteRequest:
    if not request.model:
        raise ValueError("model is required")
    return RouteRequest(
        model=request.model,
        block_hashes=tuple(request.block_hashes),
        num_prompt_tokens=request.num_prompt_tokens,
        request_id=request.request_id,
        exclude_worker_ids=frozenset(request.exclude_worker_ids),
        tenant=request.tenant,
    )


def bind_request_from_pb(request: balancer_pb2.BindDecodeRequest) -> RouteRequest:
    """Late binding's question as the router reads it: the KV's tokens stand for the prompt's."""
    if not request.model:
        raise ValueError("model is required")
    return RouteRequest(
        model=request.model,
        block_hashes=(),
        num_prompt_tokens=request.num_kv_tokens,
        request_id=request.request_id,
        exclude_worker_ids=frozenset(request.exclude_worker_ids),
    )


def assignment_to_pb(assignment: Assignment, num_cached_blocks: int) -> balancer_pb2.Assignment:
    """Peers need only the blocks the worker will newly hold (for their pending-cache view)."""
    blocks = assignment.block_hashes[num_cached_blocks : num_cached_blocks + MAX_SHARED_BLOCKS]
    return balancer_pb2.Assignment(
        balancer_id=assignment.balancer_id,
        request_id=assignment.request_id,
        assigned_s=assignment.assigned_s,
        prefill_worker_id=assignment.prefill_worker_id,
        decode_worker_id=assignment.decode_worker_id,
        num_prompt_tokens=assignment.num_prompt_tokens,
        num_uncached_tokens=assignment.num_uncached_tokens,
        prefill_s=assignment.prefill_s,
        decode_arrival_s=assignment.decode_arrival_s,
        block_hashes=blocks,
    )


def assignment_from_pb(message: balancer_pb2.Assignment) -> Assignment:
    return Assignment(
        message.balancer_id,
        message.request_id,
        message.assigned_s,
        message.prefill_worker_id,
        message.decode_worker_id,
        message.num_prompt_tokens,
        message.num_uncached_tokens,
        message.prefill_s,
        message.decode_arrival_s,
        tuple(message.block_hashes),
    )


def pool_status_pb(recommendation: PoolRecommendation) -> balancer_pb2.PoolStatus:
    return balancer_pb2.PoolStatus(
        pool=recommendation.pool,
        num_workers=recommendation.num_workers,
        num_recommended=recommendation.num_recommended,
        utilization=recommendation.utilization,
        target_utilization=recommendation.target_utilization,
    )


# -- the servicer ---------------------------------------------------------------------------------------------------
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


class Pools:
    """The registry's pools as routing sees them, and the capacity planner fed from them. The planner's only
    writer is `observe` (the pool loop)."""

    def __init__(self, registry: WorkerRegistry, planner: CapacityPlanner) -> None:
        self.registry = registry  # read only here
        self.planner = planner

    def states(self, pool: str, model: str | None = None) -> list[WorkerState]:
        return [worker_state(w, model) for w in self.registry.workers(POOL_ROLES[pool], model)]

    def observe(self, now_s: float) -> None:
        for pool in POOL_ROLES:
            self.planner.observe(pool, self.states(pool), now_s)

    def recommendations(self) -> list[PoolRecommendation]:
        return [self.planner.recommend(pool, len(self.registry.workers(role))) for pool, role in POOL_ROLES.items()]


class BalancerServicer(balancer_pb2_grpc.BalancerServicer):
    def __init__(
        self,
        pools: Pools,
        router: Router,
        lifecycle: Lifecycle,
        bus: Bus | None,
        encoders: EncoderBalancer | None = None,
    ) -> None:
        self.pools = pools
        self.router = router  # written only by Route, the peers' subscription and the registry's leave callback
        self.encoders = encoders or EncoderBalancer()  # written only by RouteEncoder and the leave callback
        self.lifecycle = lifecycle
        self.bus = bus  # publishes decisions to peers (None: not shared)

    async def Route(
        self, request: balancer_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> balancer_pb2.RouteResponse:
        try:
            with self.lifecycle.track(), status_codes():
                route, assignment = self._route(route_request_from_pb(request))
                response = balancer_pb2.RouteResponse(
                    prefill=self._info(route.prefill_worker_id),
                    decode=self._info(route.decode_worker_id) if route.decode_worker_id else None,  # None: late
                    num_cached_tokens=route.num_cached_tokens,
                    predicted_ttft_s=route.predicted_ttft_s,
                    canary=route.is_canary,
                )
        except rpc.ServiceError as error:
            await abort(context, error)
        num_cached_blocks = route.num_cached_tokens // max(model_block_size(response.prefill, request.model), 1)
        await self._share(assignment, num_cached_blocks)
        return response

    async def BindDecode(
        self, request: balancer_pb2.BindDecodeRequest, context: grpc.aio.ServicerContext
    ) -> balancer_pb2.BindDecodeResponse:
        """Late binding: the decode worker for a request whose KV is ready, shared with peers as a route is."""
        try:
            with self.lifecycle.track(), status_codes():
                decode_id, assignment = self.router.bind_decode(
                    bind_request_from_pb(request),
                    self.pools.states("decode", request.model),
                    now_s=time.time(),
                    is_canary=request.canary,
                )
                metrics.BALANCER_ROUTES.labels(pool="decode", worker=decode_id).inc()
                metrics.BALANCER_DECODE_BINDINGS.labels(binding="late").inc()
                response = balancer_pb2.BindDecodeResponse(decode=self._info(decode_id))
        except rpc.ServiceError as error:
            await abort(context, error)
        await self._share(assignment, 0)
        return response

    async def _share(self, assignment: Assignment, num_cached_blocks: int) -> None:
        if self.bus is None:
            return
        try:
            await self.bus.publish(subjects.BALANCER_ASSIGN, assignment_to_pb(assignment, num_cached_blocks))
        except Exception:  # NATS briefly away: peers miss one decision until the next heartbeats
            log.warning("assignment not shared", exc_info=True)

    def _route(self, request: RouteRequest) -> tuple[Picked, Assignment]:
        route, assignment = self.router.route(
            request,
            self.pools.states("prefill", request.model),
            self.pools.states("decode", request.model),
            now_s=time.time(),
        )
        metrics.BALANCER_ROUTES.labels(pool="prefill", worker=route.prefill_worker_id).inc()
        if route.decode_worker_id:  # late binding counts it in BindDecode
            metrics.BALANCER_ROUTES.labels(pool="decode", worker=route.decode_worker_id).inc()
            metrics.BALANCER_DECODE_BINDINGS.labels(binding="early").inc()
        return route, assignment

    def _info(self, worker_id: str) -> common_pb2.WorkerInfo:
        worker = self.pools.registry.get(worker_id)
        assert worker is not None, "picked from the registry without yielding"
        return worker.info

    async def RouteEncoder(
        self, request: balancer_pb2.RouteEncoderRequest, context: grpc.aio.ServicerContext
    ) -> balancer_pb2.RouteEncoderResponse:
        excluded = set(request.exclude_worker_ids)
        workers = [
            worker_state(w)
            for w in self.pools.registry.workers(common_pb2.ROLE_ENCODER, request.model)
            if w.worker_id not in excluded
        ]
        if not workers:
            await abort(
                context,
                rpc.ServiceError(grpc.StatusCode.UNAVAILABLE, f"no encoder worker serves {request.model!r} images"),
            )
        worker_id = self.encoders.pick(workers, request.image_hash)
        metrics.BALANCER_ROUTES.labels(pool="encoder", worker=worker_id).inc()
        return balancer_pb2.RouteEncoderResponse(encoder=self._info(worker_id))

    async def ListWorkers(
        self, request: balancer_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> balancer_pb2.ListWorkersResponse:
        statuses = [
            balancer_pb2.WorkerStatus(worker=w.info, load=w.load, last_seen_ms=w.last_seen_ms)
            for w in self.pools.registry.workers()
        ]
        pools = [pool_status_pb(r) for r in self.pools.recommendations()]
        return balancer_pb2.ListWorkersResponse(workers=statuses, pools=pools)


# -- serve ----------------------------------------------------------------------------------------------------------
def export_pool_sizes(pools: Pools) -> None:
    """BALANCER_WORKERS and BALANCER_RECOMMENDED_WORKERS read the registry and the planner at each scrape."""

    def num_workers(role: int) -> Callable[[], float]:
        return lambda: len(pools.registry.workers(role))

    def num_recommended(pool: str) -> Callable[[], float]:
        return lambda: pools.planner.recommend(pool, len(pools.registry.workers(POOL_ROLES[pool]))).num_recommended

    for pool, role in POOL_ROLES.items():
        metrics.BALANCER_WORKERS.labels(pool=pool).set_function(num_workers(role))
        metrics.BALANCER_RECOMMENDED_WORKERS.labels(pool=pool).set_function(num_recommended(pool))


async def follow_kv_events(bus: Bus, index: GlobalKVIndex, settings: BalancerSettings) -> Callable[[], Any]:
    """Replay and follow KVMESH_KV into the index, compacting the stream every `kv_snapshot_every` messages;
    without JetStream, follow the live subjects only. Returns the coroutine function that stops following."""
    follower = KVEventFollower(bus, index)
    try:
        await follower.start()
    except RuntimeError:
        log.warning("no KV event stream: the index starts empty and follows live events only")
    else:
        if not settings.kv_snapshot_every:
            return follower.stop
        compactor = KVIndexCompactor(follower, settings.kv_snapshot_every)
        compacting = asyncio.create_task(compactor.run_forever(settings.kv_snapshot_check_s))

        async def stop() -> None:
            compacting.cancel()
            await follower.stop()

        return stop

    async def on_batch(batch: events_pb2.KVEventBatch, subject: str) -> None:
        worker_id = subjects.kv_events_worker(subject, batch.worker_id)
        if worker_id is None:  # a batch about another worker than the one its subject (and permissions) name
            log.warning("KV events dropped: they name another worker", subject=subject, worker_id=batch.worker_id)
            return
        index.apply(batch, worker_id)

    subscription = await bus.subscribe(subjects.ALL_KV_EVENTS, events_pb2.KVEventBatch, on_batch)
    return subscription.unsubscribe


async def follow_rollouts(bus: Bus, router: Router, controller: RolloutController) -> Callable[[], Any] | None:
    """Route each model by its latest rollout's split (mesh.rollouts; this is the only writer of router.splits),
    feed the controller every rollout and every request's usage record, and let it judge them. Without JetStream,
    no rollouts: routing is as without one. Returns the coroutine function that stops following."""
    rollouts: dict[str, events_pb2.Rollout] = {}

    def on_change(rollout: events_pb2.Rollout) -> None:
        rollouts[rollout.rollout_id] = rollout
        router.splits = splits(rollouts.values())
        controller.on_rollout(rollout)
        log.info(
            "rollout split",
            rollout_id=rollout.rollout_id,
            model=rollout.model,
            canary_version=rollout.canary_version,
            weight=rollout.weight,
            state=rollout.state,
        )

    async def on_usage(record: events_pb2.UsageRecord, subject: str) -> None:
        controller.on_usage(record)

    try:
        following = await controller.store.follow(on_change)
    except Exception:
        log.warning("no rollout bucket: routing ignores canary rollouts", exc_info=True)
        return None
    usage = await bus.subscribe(subjects.ALL_USAGE, events_pb2.UsageRecord, on_usage)
    checking = asyncio.create_task(controller.run_forever(ROLLOUT_TICK_S))

    async def stop() -> None:
        following.cancel()
        checking.cancel()
        await usage.unsubscribe()

    return stop


async def publish_pools(bus: Bus, pools: Pools, balancer_id: str, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        pools.observe(time.time())
        message = balancer_pb2.ReplicaRecommendation(
            balancer_id=balancer_id, timestamp_ms=now_ms(), pools=[pool_status_pb(r) for r in pools.recommendations()]
        )
        try:
            await bus.publish(subjects.BALANCER_REPLICAS, message)
        except Exception:  # NATS briefly away: the next interval publishes again
            log.warning("pool recommendation not published", exc_info=True)


async def serve(settings: BalancerSettings) -> None:
    runtime = ServiceRuntime(settings, common_pb2.ROLE_BALANCER)
    bus = await runtime.connect_bus()
    index = GlobalKVIndex()
    router = Router(
        settings.balancer_policy,
        index,
        CostModel(scale=settings.balancer_cost_scale),
        balancer_id=settings.worker_id,
        decode_binding=settings.balancer_decode_binding,
    )
    log.info(
        "routing policy",
        policy=settings.balancer_policy,
        decode_binding=settings.balancer_decode_binding,
        share=settings.balancer_share_assignments,
    )

    encoders = EncoderBalancer()

    def on_leave(worker: KnownWorker) -> None:
        index.drop(worker.worker_id)
        router.forget(worker.worker_id)
        encoders.forget(worker.worker_id)

    registry = WorkerRegistry(
        bus,
        list(POOL_ROLES.values()),
        settings.heartbeat_interval_s,
        on_leave=on_leave,
        eject_after_failures=settings.eject_after_failures,
    )
    registry.check_health(runtime.channels, settings.health_check_interval_s, settings.health_check_timeout_s)
    registry.export_metrics()
    pools = Pools(registry, CapacityPlanner(settings.balancer_target_utilization))

    async def on_finished(message: events_pb2.RequestFinished, subject: str) -> None:
        router.observe_finished(
            message.worker_id,
            message.request_id,
            message.timestamp_ms / 1000.0,
            message.num_kv_tokens,
            message.num_output_tokens,
        )
        metrics.BALANCER_FINISHED_HEARD.inc()

    async def on_peer(message: balancer_pb2.Assignment, subject: str) -> None:
        router.apply(assignment_from_pb(message))
        metrics.BALANCER_PEER_ASSIGNMENTS.inc()

    def is_own(message: balancer_pb2.Assignment) -> bool:  # heard back: counted when made, and traced as no span
        return message.balancer_id == settings.worker_id

    await registry.start()
    stop_kv = await follow_kv_events(bus, index, settings)
    peers = (
        await bus.subscribe(subjects.BALANCER_ASSIGN, balancer_pb2.Assignment, on_peer, ignore=is_own, is_traced=False)
        if settings.balancer_share_assignments
        else None
    )
    # bookkeeping, untraced: the request's trace holds the span that made each event (Route or BindDecode, Stream)
    finished = await bus.subscribe(subjects.REQUESTS_FINISHED, events_pb2.RequestFinished, on_finished, is_traced=False)
    stop_rollouts = await follow_rollouts(bus, router, RolloutController(RolloutStore(bus.client), registry))
    planner_task = asyncio.create_task(publish_pools(bus, pools, settings.worker_id, settings.heartbeat_interval_s))
    export_pool_sizes(pools)
    servicer = BalancerServicer(pools, router, runtime.lifecycle, bus if peers is not None else None, encoders)
    await runtime.start(
        register=lambda server: balancer_pb2_grpc.add_BalancerServicer_to_server(servicer, server),
        load=common_pb2.WorkerLoad,
    )

    async def stop_following() -> None:
        planner_task.cancel()
        if stop_rollouts is not None:
            await stop_rollouts()
        if peers is not None:
            await peers.unsubscribe()
        await finished.unsubscribe()
        await stop_kv()
        await registry.stop()

    try:
        await runtime.wait_for_stop()
    finally:
        await runtime.shutdown(before_drain=stop_following)
