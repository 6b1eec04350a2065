"""The rollout controller: every balancer replica hears each request's outcome (its usage record) and, once per
check interval, judges the running rollouts' current step (mesh.rollout_gates); the replica whose
compare-and-set lands acts (the others lose it and leave the interval to it). A step that passes moves to the next
weight, the last one promotes; a failed gate rolls back at once (weight 0: the canary's workers finish what they
have and get nothing new; nobody kills them); too few samples hold the step.

A rollout with golden prompts is also judged by its quality probe, which the gateways run and record in the
rollout (`Rollout.quality`, services/gateway/quality_probe.py): at the first check after a mismatch was recorded
the canary rolls back, even before the step has its samples; until a match is recorded no step advances
(mesh.rollout_gates.with_quality).

Samples are attributed by the version of the worker that served them (the decode worker, else prefill's), as the
registry knows it; the canary's since its step started, the stable version's since the rollout started (at the
last step the stable version gets no traffic, and its earlier requests are still its baseline).
"""

from __future__ import annotations

import asyncio
import collections
import time

from mesh import metrics
from mesh.discovery import WorkerRegistry
from mesh.logging import get_logger
from mesh.pb import events_pb2
from mesh.rollout_gates import (
    HOLD,
    NOT_RUN,
    PROMOTE,
    ROLLBACK,
    STEP,
    GateVerdict,
    ProbeOutcome,
    ServedSample,
    judge,
    with_quality,
)
from mesh.rollouts import PROMOTED, ROLLED_BACK, RUNNING, RolloutConflict, RolloutStore

MAX_SAMPLES = 20_000  # per model: the newest
MAX_DECISIONS = 100  # kept in a rollout's entry: the newest
ROLLOUT_TICK_S = 0.1  # how often due checks are looked for (a check itself waits for its rollout's interval)
log = get_logger(__name__)


class RolloutController:
    """`rollouts` is written only by `on_rollout` (the bucket's follower); `_samples` only by `on_usage`."""

    def __init__(self, store: RolloutStore, registry: WorkerRegistry) -> None:
        self.store = store
        self.registry = registry  # read only here
        self.rollouts: dict[str, events_pb2.Rollout] = {}
        self._samples: dict[str, collections.deque[tuple[str, ServedSample]]] = {}  # model -> (version, sample)

    def on_rollout(self, rollout: events_pb2.Rollout) -> None:
        self.rollouts[rollout.rollout_id] = rollout
        latest = max(
            (r for r in self.rollouts.values() if r.model == rollout.model), key=lambda r: (r.created_ms, r.rollout_id)
        )
        metrics.ROLLOUT_WEIGHT.labels(model=rollout.model).set(latest.weight)

    def on_usage(self, record: events_pb2.UsageRecord) -> None:
        """A request ended: a sample of the version that served it. Kept whether or not this replica has heard of a
        rollout of its model yet: the rollout comes through the bucket's watch and the record through core NATS, in
        no set order, so a record heard first would otherwise be lost (`samples` counts only those since the rollout
        started). Bounded: the newest MAX_SAMPLES per model."""
        if record.status == "open":
            return
        worker = self.registry.get(record.decode_worker or record.prefill_worker)
        if worker is None:  # never routed, or the worker left: no version to blame
            return
        samples = self._samples.setdefault(record.model, collections.deque(maxlen=MAX_SAMPLES))
        samples.append((worker.info.version, ServedSample.from_usage(record)))
        metrics.ROLLOUT_SAMPLES.labels(model=record.model).inc()

    def samples(self, rollout: events_pb2.Rollout) -> tuple[list[ServedSample], list[ServedSample]]:
        """(stable's since the rollout started, canary's since its step started)."""
        found = self._samples.get(rollout.model, ())
        stable = [s for v, s in found if v == rollout.stable_version and s.at_s * 1000 >= rollout.created_ms]
        canary = [s for v, s in found if v == rollout.canary_version and s.at_s * 1000 >= rollout.step_started_ms]
        return stable, canary

    async def check(self, now_s: float) -> None:
        """Judge every running rollout whose check is due."""
        for rollout in list(self.rollouts.values()):
            if rollout.state == RUNNING and _is_due(rollout, now_s):
                try:
                    await self._check(rollout.rollout_id, now_s)
                except RolloutConflict:  # another replica acted on this interval
                    pass
                except Exception:  # NATS away: the next tick tries again
                    log.warning("rollout not checked", rollout_id=rollout.rollout_id, exc_info=True)

    async def _check(self, rollout_id: str, now_s: float) -> None:
        found = await self.store.get(rollout_id)
        if found is None:
            return
        rollout, revision = found
        if rollout.state != RUNNING or not _is_due(rollout, now_s):
            return
        stable, canary = self.samples(rollout)
        verdict = judge(rollout.gates, rollout.step_index == len(rollout.steps) - 1, stable, canary)
        probe = quality_of(rollout)
        if probe is not None:
            verdict = with_quality(verdict, probe)
        await self.store.update(decided(rollout, verdict, now_s), revision)
        metrics.ROLLOUT_DECISIONS.labels(model=rollout.model, action=verdict.action).inc()
        log.info(
            "rollout decision",
            rollout_id=rollout_id,
            model=rollout.model,
            action=verdict.action,
            reason=verdict.reason,
            num_stable=len(stable),
            num_canary=len(canary),
        )

    async def run_forever(self, tick_s: float) -> None:
        while True:
            await asyncio.sleep(tick_s)
            await self.check(time.time())


def quality_of(rollout: events_pb2.Rollout) -> ProbeOutcome | None:
    """The quality probe's outcome as the gateways recorded it (None: the rollout has no golden prompts)."""
    if not rollout.gates.quality_prompts:
        return None
    if not rollout.quality.result:
        return ProbeOutcome(NOT_RUN, "quality probe pending")
    return ProbeOutcome(rollout.quality.result, rollout.quality.reason)


def _is_due(rollout: events_pb2.Rollout, now_s: float) -> bool:
    """A rollout without an interval (never written by the admin API) is never judged."""
    return (
        rollout.check_interval_s > 0
        and now_s * 1000 - max(rollout.step_started_ms, rollout.checked_ms) >= rollout.check_interval_s * 1000
    )


def decided(rollout: events_pb2.Rollout, verdict: GateVerdict, now_s: float) -> events_pb2.Rollout:
    """The rollout after `verdict`, its decision appended."""
    after = events_pb2.Rollout()
    after.CopyFrom(rollout)
    now_ms = int(now_s * 1000)
    after.checked_ms = now_ms
    if verdict.action == STEP:
        after.step_index += 1
        after.weight = after.steps[after.step_index]
        after.step_started_ms = now_ms
    elif verdict.action == PROMOTE:
        after.state, after.weight = PROMOTED, 100
    elif verdict.action == ROLLBACK:
        after.state, after.weight = ROLLED_BACK, 0
    else:
        assert verdict.action == HOLD, verdict.action
    after.decisions.append(
        events_pb2.RolloutDecision(at_ms=now_ms, action=verdict.action, weight=after.weight, reason=verdict.reason)
    )
    del after.decisions[:-MAX_DECISIONS]
    return after
