"""Outlier ejection, as Envoy does it: a worker whose calls or health checks fail `eject_after` times in a row is
taken out of its pools; the next success (a health check that answers SERVING, a heartbeat) re-admits it.

Only consecutive failures count: one success in between starts the count over, so a worker that drops one call
in a thousand is never ejected, while a dead one (every call refused at once) is out after `eject_after` tries.
"""

from __future__ import annotations


class OutlierDetector:
    """Failure counts per worker. One writer: the WorkerRegistry that owns it (calls and checks report to it)."""

    def __init__(self, eject_after: int) -> None:
        if eject_after < 1:
            raise ValueError(f"eject_after={eject_after}: must be at least 1")
        self.eject_after = eject_after
        self._num_failures: dict[str, int] = {}  # worker id -> consecutive failures (absent: 0)
        self._ejected: set[str] = set()
        self.num_ejections = 0  # since start, for metrics

    def failure(self, worker_id: str) -> bool:
        """Count one failed call or check; True when this one ejected the worker."""
        num_failures = self._num_failures.get(worker_id, 0) + 1
        self._num_failures[worker_id] = num_failures
        if num_failures < self.eject_after or worker_id in self._ejected:
            return False
        self._ejected.add(worker_id)
        self.num_ejections += 1
        return True

    def success(self, worker_id: str) -> bool:
        """The worker answered; True when this re-admitted it."""
        self._num_failures.pop(worker_id, None)
        if worker_id not in self._ejected:
            return False
        self._ejected.discard(worker_id)
        return True

    def is_ejected(self, worker_id: str) -> bool:
        return worker_id in self._ejected

    def num_failures(self, worker_id: str) -> int:
        return self._num_failures.get(worker_id, 0)

    @property
    def ejected_ids(self) -> frozenset[str]:
        return frozenset(self._ejected)

    def forget(self, worker_id: str) -> None:
        """The worker left for good: nothing is kept of it."""
        self._num_failures.pop(worker_id, None)
        self._ejected.discard(worker_id)
