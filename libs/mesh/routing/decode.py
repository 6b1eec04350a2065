"""Decode policies: which decode worker runs a request's generation. They read the LoadView: reported running
requests and KV tokens, plus the requests assigned since whose KV is on its way.

- `round_robin`: the next worker in id order.
- `least_requests`: fewest requests (what balancing by count gives).
- `least_kv`: fewest KV tokens (Dynamo's active decode blocks).
- `deepseek`: least requests / max_num_seqs + KV tokens / KV capacity (request count and total KV length).
- `kvmesh`: least predicted KV (`mesh.routing.kvmesh.KvmeshDecode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mesh.routing.state import RouteRequest, WorkerState
from mesh.routing.view import LoadView


class DecodePolicy(Protocol):
    def pick(
        self, request: RouteRequest, workers: Sequence[WorkerState], view: LoadView, now_s: float, arrival_s: float
    ) -> str: ...

    def observe_output(self, num_output_tokens: int) -> None:
        """A finished request's output length (what a policy may learn expected outputs from)."""
        ...


class _NoLearning:
    def observe_output(self, num_output_tokens: int) -> None:
        pass


class RoundRobinDecode(_NoLearning):
    def __init__(self) -> None:
        self._next = 0  # only `pick` writes it

    def pick(
        self, request: RouteRequest, workers: Sequence[WorkerState], view: LoadView, now_s: float, arrival_s: float
    ) -> str:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker.worker_id


class LeastRequestsDecode(_NoLearning):
    def pick(
        self, request: RouteRequest, workers: Sequence[WorkerState], view: LoadView, now_s: float, arrival_s: float
    ) -> str:
        return min(workers, key=lambda w: (view.num_requests(w), view.num_kv_tokens(w), w.worker_id)).worker_id


class LeastKVDecode(_NoLearning):
    def pick(
        self, request: RouteRequest, workers: Sequence[WorkerState], view: LoadView, now_s: float, arrival_s: float
    ) -> str:
        return min(workers, key=lambda w: (view.num_kv_tokens(w), view.num_requests(w), w.worker_id)).worker_id


class DeepSeekDecode(_NoLearning):
    @staticmethod
    def load(worker: WorkerState, view: LoadView) -> float:
        seqs = view.num_requests(worker) / max(worker.max_num_seqs, 1)
        return seqs + view.num_kv_tokens(worker) / max(worker.num_kv_capacity_tokens, 1)

    def pick(
        self, request: RouteRequest, workers: Sequence[WorkerState], view: LoadView, now_s: float, arrival_s: float
    ) -> str:
        return min(workers, key=lambda w: (self.load(w, view), w.worker_id)).worker_id
