"""What the gateway knows of the mesh, from heartbeats and health checks: live balancers, and which models have
both a live prefill and a live decode worker. A view over the registry (the registry's tasks write it; failed
calls are reported to it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from mesh.discovery import KnownWorker
from mesh.pb import common_pb2

FOLLOWED_ROLES = (common_pb2.ROLE_BALANCER, common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_ENCODER)


class Registry(Protocol):
    def workers(self, role: int | None = None, model: str | None = None) -> list[KnownWorker]: ...

    def record_failure(self, worker_id: str) -> None: ...


class MeshView:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._next_balancer = 0  # round-robin start; only `balancers()` writes it

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
