"""A compute worker's side of expert rebalancing, for each MoE model it serves (on when KVMESH_EXPERT_REPORT_STEPS
is above 0).

- Reports: once an engine has run `report_steps` steps since its last report (checked every POLL_S), its
  counts go out as an ExpertLoad on kvmesh.experts.load.<model>.
- Plans: an ExpertPlan on kvmesh.experts.plan.<model> that fits the engine and is newer than what it runs is
  prepared on a worker thread (the new weight stacks; the engine keeps stepping) and then applied by the engine
  thread between two steps. No request is paused or dropped.
"""

from __future__ import annotations

import asyncio
import contextlib

from engine_core.async_engine import AsyncEngine
from engine_core.expert_parallel import ExpertLayout, ExpertLoadReport
from mesh import subjects
from mesh.bus import Bus
from mesh.logging import get_logger
from mesh.pb import expert_lb_pb2

POLL_S = 0.05
log = get_logger(__name__)


def load_to_proto(
    worker_id: str, model: str, layout: ExpertLayout, report: ExpertLoadReport, seq: int
) -> expert_lb_pb2.ExpertLoad:
    return expert_lb_pb2.ExpertLoad(
        worker_id=worker_id,
        model=model,
        num_layers=layout.num_layers,
        num_experts=layout.num_experts,
        counts=[c for row in report.counts for c in row],
        step=seq,
        first_layer=layout.first_layer,
        num_groups=layout.num_groups,
        num_physical_experts=layout.num_slots,
        num_gpus=layout.num_ranks,
        gpu_loads=[c for row in report.rank_loads for c in row],
        plan_version=report.version,
        num_steps=report.num_steps,
    )


def plan_rows(plan: expert_lb_pb2.ExpertPlan, layout: ExpertLayout) -> list[list[int]] | None:
    """The plan's (layers, slots) placement, or None when it was made for another shape of engine."""
    if (plan.num_layers, plan.num_physical_experts, plan.num_gpus) != (
        layout.num_layers,
        layout.num_slots,
        layout.num_ranks,
    ):
        return None
    if len(plan.phy2log) != layout.num_layers * layout.num_slots:
        return None
    flat = list(plan.phy2log)
    return [flat[i * layout.num_slots : (i + 1) * layout.num_slots] for i in range(layout.num_layers)]


class ExpertSync:
    """Written only on the event loop; the engines' state only through AsyncEngine (`call`, its snapshots)."""

    def __init__(self, engines: dict[str, AsyncEngine], bus: Bus, worker_id: str, report_steps: int) -> None:
        assert report_steps > 0
        self.bus = bus
        self.worker_id = worker_id
        self.report_steps = report_steps
        self.engines = {m: e for m, e in engines.items() if e.expert_layout is not None}
        self.num_reports = dict.fromkeys(self.engines, 0)
        self.applied_version = dict.fromkeys(self.engines, 0)
        self._locks = {model: asyncio.Lock() for model in self.engines}
        self._subscriptions: list = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for model in self.engines:

            async def on_plan(plan: expert_lb_pb2.ExpertPlan, subject: str, model: str = model) -> None:
                if plan.model == model:
                    await self.apply(model, plan)

            self._subscriptions.append(
                await self.bus.subscribe(subjects.expert_plan(model), expert_lb_pb2.ExpertPlan, on_plan)
            )
        if self.engines:
            self._task = asyncio.create_task(self._report_forever())
            log.info("expert reports on", models=list(self.engines), report_steps=self.report_steps)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):  # the bus may be closed already
                await subscription.unsubscribe()
        self._subscriptions.clear()

    async def _report_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            for model in self.engines:
                try:
                    await self.report(model)
                except Exception:  # a lost report costs one window's precision, never a request
                    log.exception("expert load report failed", model=model)

    async def report(self, model: str, min_steps: int | None = None) -> bool:
        """Publish the model's counts if enough steps ran; whether it did."""
        engine = self.engines[model]
        steps = self.report_steps if min_steps is None else min_steps
        # the engine thread's snapshot of its step counter: a stale value delays the report by one poll, and an
        # idle engine is not woken 20 times a second; counts wait while the bus is down (or closing)
        if engine.num_expert_steps < steps or not self.bus.is_connected:
            return False
        report = await engine.call(lambda e: e.take_expert_report(steps))
        if report is None:
            return False
        layout = engine.expert_layout
        assert layout is not None
        self.num_reports[model] += 1
        await self.bus.publish(
            subjects.expert_load(model), load_to_proto(self.worker_id, model, layout, report, self.num_reports[model])
        )
        return True

    async def apply(self, model: str, plan: expert_lb_pb2.ExpertPlan) -> bool:
        """Prepare the plan's weights off the engine thread, then switch between two steps; whether it did."""
        engine = self.engines[model]
        layout = engine.expert_layout
        assert layout is not None
        rows = plan_rows(plan, layout)
        if rows is None:
            log.warning(
                "expert plan ignored: made for another layout",
                model=model,
                version=plan.version,
                plan_slots=plan.num_physical_experts,
                plan_gpus=plan.num_gpus,
                slots=layout.num_slots,
                gpus=layout.num_ranks,
            )
            return False
        async with self._locks[model]:  # one plan at a time: a burst of plans costs one copy each, in order
            if plan.version <= self.applied_version[model]:
                return False
            prepared = await engine.prepare_expert_placement(rows, plan.version)
            applied = await engine.call(lambda e: e.apply_expert_placement(prepared))
            if applied:
                self.applied_version[model] = plan.version
                log.info("expert plan applied", model=model, version=plan.version, num_moved=plan.num_moved)
            return applied
