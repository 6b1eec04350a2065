"""What the gateway knows of the mesh, from heartbeats, health checks and its own streams: live balancers, which
models have both a live prefill and a live decode worker, and which decode workers are too slow to route to. A
view over the registry (the registry's tasks write it; failed calls are reported to it) and the latency outlier
detector (the streams' token gaps are reported to it: mesh/latency_outliers.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from mesh import tracing
from mesh.discovery import KnownWorker, model_block_size
from mesh.latency_outliers import Ejection, LatencyOutlierDetector, LatencyRule
from mesh.logging import get_logger
from mesh.metrics import GATEWAY_DECODE_EJECTIONS
from mesh.pb import common_pb2

log = get_logger(__name__)
NO_LATENCY_RULE = LatencyRule(factor=0)  # embedding and unit tests: no decode worker is ever slow

FOLLOWED_ROLES = (common_pb2.ROLE_BALANCER, common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_ENCODER)


class Registry(Protocol):
    def workers(self, role: int | None = None, model: str | None = None) -> list[KnownWorker]: ...

    def record_failure(self, worker_id: str) -> None: ...


class MeshView:
    def __init__(
        self,
        registry: Registry,
        slow_decode: LatencyRule = NO_LATENCY_RULE,
        clock: Callable[[], float] = time.monotonic,
        unrouted_stall_s: float | None = None,
    ) -> None:
        """`unrouted_stall_s`: how long a stream waits for its next token from a decode worker that has left the
        routes (failed health checks: a stopped or dead process; or gone) when the pool has no latency of its
        own to compare with (too few streams on the others); None: it waits for that worker."""
        self._registry = registry
        self._next_balancer = 0  # round-robin start; only `balancers()` writes it
        self.latency = LatencyOutlierDetector(slow_decode, self.decode_ids)
        self._clock = clock
        self.unrouted_stall_s = unrouted_stall_s
        self._block_size_conflicts: dict[str, list[tuple[str, int]]] = {}  # model -> the sizes last logged

    def decode_ids(self, model: str) -> list[str]:
        """The decode workers that may serve `model` now: known, and not ejected for failures."""
        return [w.worker_id for w in self._registry.workers(common_pb2.ROLE_DECODE, model)]

    def record_token_gap(self, model: str, decode_worker: str, gap_s: float, num_tokens: int) -> None:
        """`num_tokens` arrived from `decode_worker` `gap_s` after the stream's previous ones: one ITL sample,
        which may eject the worker for being slow (logged, counted, and an event on the request's span)."""
        ejection = self.latency.record(model, decode_worker, gap_s, self._clock(), num_tokens)
        if ejection is not None:
            report_ejection(ejection)

    def slow_decode_ids(self, model: str, excluded: Sequence[str] = ()) -> list[str]:
        """The decode workers of `model` ejected for latency, to keep out of a route besides `excluded`; none when
        that would leave no decode worker outside them (a slow worker serves; an empty pool fails the request)."""
        slow = [w for w in self.latency.ejected_ids(model, self._clock()) if w not in excluded]
        if not slow:
            return []
        left = set(self.decode_ids(model)) - set(excluded) - set(slow)
        return slow if left else []

    @property
    def watches_stalls(self) -> bool:
        """Whether streams look at `stall_limit_s` at all."""
        return self.latency.rule.is_enabled or self.unrouted_stall_s is not None

    def stall_limit_s(self, model: str, decode_worker: str) -> float | None:
        """How long a stream on `decode_worker` may wait for its next token before it migrates, once the worker
        is out of routing (slow, or failing its checks: stopped, starved; or gone); None while it is in.
        slow_decode_factor x the pool's others' ITL where that is known, else, for a worker out for failed
        checks or gone (not merely slow), `unrouted_stall_s`."""
        rule = self.latency.rule
        now_s = self._clock()
        is_unrouted = decode_worker not in self.decode_ids(model)
        is_slow = rule.is_enabled and self.latency.is_ejected(model, decode_worker, now_s)
        if not (is_unrouted or is_slow):
            return None
        reference_s = self.latency.reference_s(model, decode_worker, now_s) if rule.is_enabled else None
        if reference_s is not None:
            return rule.factor * max(reference_s, rule.min_itl_s)
        return self.unrouted_stall_s if is_unrouted else None

    def block_size(self, model: str, default: int) -> int | None:
        """The tokens per block `model`'s prefill and decode workers report (their engines' block size, what the
        workers' block keys are hashed by): `default` while none is known; None when they disagree (an error,
        logged once per disagreement: the request is routed without cache affinity, never by wrong keys)."""
        workers = [
            *self._registry.workers(common_pb2.ROLE_PREFILL, model),
            *self._registry.workers(common_pb2.ROLE_DECODE, model),
        ]
        sizes = sorted({(w.worker_id, model_block_size(w.info, model)) for w in workers})
        distinct = {size for _, size in sizes}
        if not distinct:
            return default
        if len(distinct) == 1:
            self._block_size_conflicts.pop(model, None)
            return distinct.pop()
        if self._block_size_conflicts.get(model) != sizes:
            self._block_size_conflicts[model] = sizes
            log.error(
                "workers disagree on a model's block size: routing it without cache affinity",
                model=model,
                block_sizes=dict(sizes),
            )
        return None

    def balancers(self) -> list[KnownWorker]:
        """Live balancers, starting with a different one each call so the load spreads."""
        live = self._registry.workers(common_pb2.ROLE_BALANCER)
        if not live:
            return []
        start = self._next_balancer % len(live)
        self._next_balancer += 1
        return live[start:] + live[:start]

    def report_failure(self, worker_id: str) -> None:
        """A call to the worker failed (unreachable): counted towards its ejection (mesh.outliers)."""
        self._registry.record_failure(worker_id)

    def is_served(self, model: str) -> bool:
        return bool(
            self._registry.workers(common_pb2.ROLE_PREFILL, model)
            and self._registry.workers(common_pb2.ROLE_DECODE, model)
        )

    def served_models(self, candidates: Iterable[str]) -> list[str]:
        return [model for model in candidates if self.is_served(model)]

    def is_ready(self, candidates: Iterable[str]) -> bool:
        """A balancer to ask, and some model with workers on both sides."""
        return bool(self._registry.workers(common_pb2.ROLE_BALANCER)) and bool(self.served_models(candidates))


def report_ejection(ejection: Ejection) -> None:
    GATEWAY_DECODE_EJECTIONS.labels("latency").inc()
    log.warning(
        "decode worker ejected: slow",
        worker_id=ejection.worker_id,
        model=ejection.pool,
        itl_ms=round(ejection.itl_s * 1000, 1),
        pool_itl_ms=round(ejection.reference_s * 1000, 1),
        num_in_a_row=ejection.num_in_a_row,
    )
    span = tracing.current_span()  # the request whose tokens showed it
    if span.is_recording():
        span.add_event(
            "kvmesh.decode_ejected",
            {
                "kvmesh.decode_worker_id": ejection.worker_id,
                "kvmesh.itl_ms": ejection.itl_s * 1000,
                "kvmesh.pool_itl_ms": ejection.reference_s * 1000,
            },
        )
