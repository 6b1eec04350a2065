"""The ExpertBalancer servicer and `serve()`: expert loads from NATS into the ExpertRebalancer, a plan every
interval published on NATS (and served by GetPlan), metrics.

Loads: kvmesh.experts.load.> (ExpertLoad from every worker with KVMESH_EXPERT_REPORT_STEPS > 0). Plans:
kvmesh.experts.plan.<model>. The placement search runs on a worker thread; the event loop keeps taking loads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import NoReturn

import grpc
import grpc.aio
import numpy as np

from mesh import metrics, rpc, subjects
from mesh.bus import Bus
from mesh.discovery import now_ms
from mesh.logging import get_logger
from mesh.pb import common_pb2, expert_lb_pb2, expert_lb_pb2_grpc
from mesh.service import Lifecycle, ServiceRuntime
from services.expert_lb.config import ExpertLBSettings
from services.expert_lb.rebalancer import ExpertPlanRecord, ExpertRebalancer, LoadReport, ModelShape, compute

log = get_logger(__name__)


class NoPlanError(LookupError):
    """No plan for the model yet (no loads heard, or not a whole interval of them)."""


def load_from_pb(load: expert_lb_pb2.ExpertLoad) -> LoadReport:
    """ValueError for a report whose sizes do not add up."""
    if not load.model:
        raise ValueError("an expert load names no model")
    shape = ModelShape(
        load.num_layers,
        load.first_layer,
        load.num_experts,
        max(load.num_groups, 1),
        load.num_physical_experts or load.num_experts,
        max(load.num_gpus, 1),
    )
    if shape.num_layers <= 0 or shape.num_experts <= 0 or len(load.counts) != shape.num_layers * shape.num_experts:
        raise ValueError(f"{len(load.counts)} counts for {shape.num_layers} layers of {shape.num_experts} experts")
    if shape.num_slots < shape.num_experts or shape.num_slots % shape.num_gpus or shape.num_experts % shape.num_groups:
        raise ValueError(
            f"{shape.num_slots} slots on {shape.num_gpus} GPUs for {shape.num_experts} experts in "
            f"{shape.num_groups} groups do not fit together"
        )
    counts = np.asarray(load.counts, dtype=np.int64).reshape(shape.num_layers, shape.num_experts)
    if (counts < 0).any():
        raise ValueError("expert counts must not be negative")
    return LoadReport(load.worker_id, load.model, shape, counts, load.plan_version)


def plan_to_pb(record: ExpertPlanRecord) -> expert_lb_pb2.ExpertPlan:
    shape = record.shape
    return expert_lb_pb2.ExpertPlan(
        model=record.model,
        version=record.version,
        num_layers=shape.num_layers,
        num_physical_experts=shape.num_slots,
        phy2log=record.phy2log.ravel().tolist(),
        balancedness=record.balancedness.tolist(),
        num_moved=record.num_moved,
        num_gpus=shape.num_gpus,
        first_layer=shape.first_layer,
        num_experts=shape.num_experts,
        policy=record.policy,
        gpu_loads=record.gpu_loads.ravel().tolist(),
    )


def export_plan(record: ExpertPlanRecord) -> None:
    for layer, value in enumerate(record.balancedness):
        metrics.EXPERT_BALANCEDNESS.labels(model=record.model, layer=str(record.shape.first_layer + layer)).set(value)
    metrics.EXPERT_MOVES.labels(model=record.model).inc(record.num_moved)


async def plan_once(rebalancer: ExpertRebalancer, bus: Bus) -> list[ExpertPlanRecord]:
    """Close the interval, compute each model's plan off the loop, publish what changed; the plans published."""
    jobs, resend = rebalancer.begin_plans()
    for previous in resend:
        await bus.publish(subjects.expert_plan(previous.model), plan_to_pb(previous))
    loop = asyncio.get_running_loop()
    published: list[ExpertPlanRecord] = []
    for job in jobs:
        result = await loop.run_in_executor(None, compute, job)
        record = rebalancer.commit(job, result, now_ms())
        if record is None:
            continue
        await bus.publish(subjects.expert_plan(record.model), plan_to_pb(record))
        export_plan(record)
        published.append(record)
        log.info(
            "expert plan published",
            model=record.model,
            version=record.version,
            policy=record.policy,
            num_moved=record.num_moved,
            balancedness=round(float(record.balancedness.mean()), 4),
        )
    return published


async def plan_forever(rebalancer: ExpertRebalancer, bus: Bus, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await plan_once(rebalancer, bus)
        except Exception:  # a failed plan keeps the current placement; the next interval tries again
            log.exception("expert planning failed")


async def abort(context: grpc.aio.ServicerContext, error: rpc.ServiceError) -> NoReturn:
    await rpc.abort_with(context, error)
    raise AssertionError("unreachable: abort raises") from error


class ExpertBalancerServicer(expert_lb_pb2_grpc.ExpertBalancerServicer):
    def __init__(self, rebalancer: ExpertRebalancer, lifecycle: Lifecycle) -> None:
        self.rebalancer = rebalancer  # read only here
        self.lifecycle = lifecycle

    async def GetPlan(
        self, request: expert_lb_pb2.GetPlanRequest, context: grpc.aio.ServicerContext
    ) -> expert_lb_pb2.ExpertPlan:
        try:
            with self.lifecycle.track(), status_codes():
                record = self.rebalancer.plan(request.model)
                if record is None:
                    raise NoPlanError(f"no expert plan for model {request.model!r} yet")
                return plan_to_pb(record)
        except rpc.ServiceError as error:
            await abort(context, error)


@contextlib.contextmanager
def status_codes() -> Iterator[None]:
    """The one place this service chooses status codes."""
    try:
        with rpc.status_on_error():
            yield
    except NoPlanError as exc:
        raise rpc.ServiceError(grpc.StatusCode.NOT_FOUND, str(exc)) from exc


async def serve(settings: ExpertLBSettings) -> None:
    runtime = ServiceRuntime(settings, common_pb2.ROLE_EXPERT_LB)
    bus = await runtime.connect_bus()
    rebalancer = ExpertRebalancer(
        settings.expert_window_intervals,
        settings.expert_num_nodes,
        settings.expert_policy,
        settings.expert_max_moves_fraction,
        settings.expert_min_gain,
        settings.expert_replan_gain,
        settings.expert_min_window_tokens,
    )

    async def on_load(load: expert_lb_pb2.ExpertLoad, subject: str) -> None:
        try:
            rebalancer.record(load_from_pb(load))
        except ValueError as exc:
            log.warning("expert load dropped", worker_id=load.worker_id, model=load.model, error=str(exc))

    subscription = await bus.subscribe(subjects.ALL_EXPERT_LOADS, expert_lb_pb2.ExpertLoad, on_load)
    servicer = ExpertBalancerServicer(rebalancer, runtime.lifecycle)
    await runtime.start(
        register=lambda server: expert_lb_pb2_grpc.add_ExpertBalancerServicer_to_server(servicer, server),
        load=common_pb2.WorkerLoad,
    )
    planner = asyncio.create_task(plan_forever(rebalancer, bus, settings.expert_plan_interval_s))

    async def stop_following() -> None:
        planner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await planner
        await subscription.unsubscribe()

    try:
        await runtime.wait_for_stop()
    finally:
        await runtime.shutdown(before_drain=stop_following)
