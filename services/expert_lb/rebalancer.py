"""ExpertRebalancer: per model, a moving window of the expert loads its workers report, and the placement planned
from it. Pure logic: the server feeds it reports and asks for plans every interval; it publishes what comes back.

Every interval: the loads reported during it become the newest of `window_intervals` buckets, and the window's
sum (all workers of the model together: they all run the same placement) is planned by mesh.eplb from the
current placement, moving at most the configured share of slots per layer. A plan that changes nothing is not
published. A worker that reports an older plan version than the current one (it started late, or missed a
message) gets the current plan again.

Only `record`, `begin_plans` and `commit` write state; the server calls them on its event loop. `compute`
(the placement search, CPU-heavy) reads nothing shared and runs on a worker thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mesh import eplb
from mesh.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """What every worker of a model runs, as its reports say."""

    num_layers: int  # MoE layers
    first_layer: int
    num_experts: int
    num_groups: int
    num_slots: int  # physical slots per layer
    num_gpus: int  # expert-parallel ranks


@dataclass(frozen=True)
class LoadReport:
    worker_id: str
    model: str
    shape: ModelShape
    counts: np.ndarray  # (layers, experts) tokens routed since the worker's last report
    plan_version: int  # the plan the worker runs


@dataclass(frozen=True)
class ExpertPlanRecord:
    model: str
    version: int
    shape: ModelShape
    policy: str
    phy2log: np.ndarray  # (layers, slots)
    balancedness: np.ndarray  # (layers,) over the window the plan was made from
    gpu_loads: np.ndarray  # (layers, gpus)
    num_moved: int  # slots whose expert differs from the previous plan (or the default placement)


@dataclass(frozen=True)
class PlanJob:
    """What one model's plan is computed from: a snapshot, so `compute` shares nothing with the event loop."""

    model: str
    shape: ModelShape
    weight: np.ndarray  # (layers, experts): the window's sum
    current: np.ndarray  # (layers, slots): what the workers run
    topology: eplb.Topology
    options: eplb.PlanOptions


@dataclass
class _ModelState:
    shape: ModelShape
    current: np.ndarray  # (layers, slots)
    window: deque[np.ndarray]  # per interval (layers, experts), newest last
    pending: np.ndarray  # this interval's loads so far
    plan: ExpertPlanRecord | None = None
    workers_behind: set[str] = field(default_factory=set)


def compute(job: PlanJob) -> eplb.Plan:
    """The plan for a job (CPU-heavy: call it off the event loop)."""
    return eplb.rebalance(job.weight, job.topology, job.current, job.options)


class ExpertRebalancer:
    def __init__(
        self,
        window_intervals: int,
        num_nodes: int,
        policy: str,
        max_moves_fraction: float,
        min_gain: float,
        replan_gain: float,
        min_window_tokens: int = 1,
    ) -> None:
        self.window_intervals = window_intervals
        self.num_nodes = num_nodes
        self.policy = policy
        self.max_moves_fraction = max_moves_fraction
        self.min_gain = min_gain
        self.replan_gain = replan_gain
        self.min_window_tokens = min_window_tokens
        self._models: dict[str, _ModelState] = {}

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def plan(self, model: str) -> ExpertPlanRecord | None:
        state = self._models.get(model)
        return None if state is None else state.plan

    def record(self, report: LoadReport) -> None:
        """Add a worker's counts to this interval. A model whose shape changed (redeployed) starts over."""
        shape = report.shape
        if report.counts.shape != (shape.num_layers, shape.num_experts):
            raise ValueError(
                f"counts of shape {report.counts.shape} do not match {shape.num_layers} layers of "
                f"{shape.num_experts} experts"
            )
        state = self._models.get(report.model)
        if state is None or state.shape != shape:
            if state is not None:
                log.warning("expert layout changed; starting over", model=report.model, worker_id=report.worker_id)
            state = self._models[report.model] = self._new_state(shape)
        state.pending += report.counts
        if state.plan is not None and report.plan_version < state.plan.version:
            state.workers_behind.add(report.worker_id)

    def _new_state(self, shape: ModelShape) -> _ModelState:
        default = np.tile(eplb.default_placement(shape.num_experts, shape.num_slots), (shape.num_layers, 1))
        return _ModelState(
            shape,
            default,
            deque(maxlen=self.window_intervals),
            np.zeros((shape.num_layers, shape.num_experts), dtype=np.int64),
        )

    def begin_plans(self) -> tuple[list[PlanJob], list[ExpertPlanRecord]]:
        """Close the interval: (jobs to compute, current plans to send again to workers behind)."""
        jobs, resend = [], []
        for model, state in self._models.items():
            state.window.append(state.pending)
            state.pending = np.zeros_like(state.pending)
            if state.workers_behind and state.plan is not None:
                resend.append(state.plan)
            state.workers_behind.clear()
            weight = np.sum(state.window, axis=0)
            if weight.sum(axis=1).min() >= self.min_window_tokens:
                jobs.append(self._job(model, state, weight))
        return jobs, resend

    def _job(self, model: str, state: _ModelState, weight: np.ndarray) -> PlanJob:
        shape = state.shape
        nodes = self.num_nodes if shape.num_gpus % self.num_nodes == 0 else 1
        topology = eplb.Topology(shape.num_slots, shape.num_groups, nodes, shape.num_gpus)
        policy = self.policy
        if policy == "hierarchical" and shape.num_groups % nodes:
            policy = "global"  # hierarchical needs the groups to split evenly over the nodes
        limit = None if self.max_moves_fraction >= 1 else int(self.max_moves_fraction * shape.num_slots)
        options = eplb.PlanOptions(policy, limit, self.min_gain, self.replan_gain)
        return PlanJob(model, shape, weight.astype(np.float64), state.current.copy(), topology, options)

    def commit(self, job: PlanJob, result: eplb.Plan, now_ms: int) -> ExpertPlanRecord | None:
        """Take a computed plan; the record to publish, or None when it changes nothing (or came too late:
        the model started over meanwhile)."""
        state = self._models.get(job.model)
        if state is None or state.shape != job.shape or not np.array_equal(state.current, job.current):
            return None
        num_moved = int(result.num_moved.sum())
        if state.plan is not None and num_moved == 0:
            return None
        version = max(now_ms, state.plan.version + 1 if state.plan is not None else 1)
        record = ExpertPlanRecord(
            job.model,
            version,
            job.shape,
            result.policy,
            result.phy2log,
            result.balancedness,
            result.gpu_loads,
            num_moved,
        )
        state.current = result.phy2log
        state.plan = record
        return record
