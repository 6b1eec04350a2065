"""Router: picks the (prefill, decode) pair for one request. Pure logic: the server hands it the live pools (from
heartbeats) and reads the KV index; it returns worker ids and keeps only what it routed itself.

- Prefill: least predicted work = queued prompt tokens (the last heartbeat's, plus the uncached tokens this router
  sent the worker since that heartbeat, so a burst between two heartbeats spreads) + this request's tokens the
  worker does not hold (prompt tokens - block_size x its leading cached blocks). Ties: fewest picks among the last
  `num_recent_routes` prefill routes, then worker id.
- Decode: least (requests / max_num_seqs + KV tokens / KV capacity in tokens), each counting what this router sent
  since the heartbeat (a routed request brings its prompt's KV). Ties: worker id.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.balancer.kv_index import KVIndex


@dataclass(frozen=True)
class WorkerState:
    """A worker as its last heartbeat described it (the server fills it from the WorkerRegistry)."""

    worker_id: str
    heartbeat_ms: int  # when that heartbeat arrived: a new value means a new report, so routed counts restart
    block_size: int
    max_num_seqs: int
    num_kv_blocks: int
    num_running: int = 0
    num_queued_prompt_tokens: int = 0
    num_kv_tokens: int = 0


@dataclass(frozen=True)
class RouteRequest:
    model: str
    block_hashes: tuple[bytes, ...]  # the prompt's full-block keys
    num_prompt_tokens: int
    exclude_worker_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class WorkerPair:
    prefill_worker_id: str
    decode_worker_id: str
    num_cached_tokens: int  # the prefix the prefill worker is expected to hold


class NoWorkerError(Exception):
    """No live worker of a pool serves the model (the server answers UNAVAILABLE)."""

    def __init__(self, pool: str, model: str, num_excluded: int) -> None:
        excluded = f" ({num_excluded} excluded)" if num_excluded else ""
        super().__init__(f"no {pool} worker serves model {model!r}{excluded}")
        self.pool = pool
        self.model = model


@dataclass(frozen=True)
class _Routed:
    """What this router sent one worker since its heartbeat `heartbeat_ms`."""

    heartbeat_ms: int
    num_requests: int = 0
    num_tokens: int = 0  # prefill: uncached prompt tokens; decode: prompt tokens (the KV it will hold)


class Router:
    """Only `route` and `forget` write its state; the server calls them from one event loop."""

    def __init__(self, index: KVIndex, num_recent_routes: int = 64) -> None:
        assert num_recent_routes > 0
        self.index = index  # read only here
        self._routed: dict[str, _Routed] = {}
        self._recent_prefill: deque[str] = deque()
        self._num_recent_routes = num_recent_routes
        self._recent_counts: Counter[str] = Counter()

    def route(self, request: RouteRequest, prefill: Sequence[WorkerState], decode: Sequence[WorkerState]) -> WorkerPair:
        """The pair for `request` from the pools serving its model; NoWorkerError when a pool has nobody left."""
        if request.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must not be negative, got {request.num_prompt_tokens}")
        prefill_pool = self._eligible(request, prefill, "prefill")
        decode_pool = self._eligible(request, decode, "decode")
        prefill_worker = min(prefill_pool, key=lambda w: self._prefill_key(request, w))
        decode_worker = min(decode_pool, key=lambda w: (self.decode_load(w), w.worker_id))
        num_cached_tokens = self.num_cached_tokens(request, prefill_worker)
        self._record(prefill_worker, max(request.num_prompt_tokens - num_cached_tokens, 0))
        self._record(decode_worker, request.num_prompt_tokens)
        self._remember_prefill(prefill_worker.worker_id)
        return WorkerPair(prefill_worker.worker_id, decode_worker.worker_id, num_cached_tokens)

    def forget(self, worker_id: str) -> None:
        """The worker left its pool."""
        self._routed.pop(worker_id, None)

    def num_cached_tokens(self, request: RouteRequest, worker: WorkerState) -> int:
        return worker.block_size * self.index.num_leading_hits(worker.worker_id, request.block_hashes)

    def prefill_work(self, request: RouteRequest, worker: WorkerState) -> int:
        """Prompt tokens the worker would compute before this request's first token."""
        queued = worker.num_queued_prompt_tokens + self._since_heartbeat(worker).num_tokens
        return queued + max(request.num_prompt_tokens - self.num_cached_tokens(request, worker), 0)

    def decode_load(self, worker: WorkerState) -> float:
        routed = self._since_heartbeat(worker)
        seqs = (worker.num_running + routed.num_requests) / max(worker.max_num_seqs, 1)
        kv = (worker.num_kv_tokens + routed.num_tokens) / max(worker.num_kv_blocks * worker.block_size, 1)
        return seqs + kv

    def _prefill_key(self, request: RouteRequest, worker: WorkerState) -> tuple[int, int, str]:
        return self.prefill_work(request, worker), self._recent_counts[worker.worker_id], worker.worker_id

    def _eligible(self, request: RouteRequest, pool: Sequence[WorkerState], name: str) -> list[WorkerState]:
        workers = [w for w in pool if w.worker_id not in request.exclude_worker_ids]
        if not workers:
            raise NoWorkerError(name, request.model, len(pool) - len(workers))
        return workers

    def _since_heartbeat(self, worker: WorkerState) -> _Routed:
        routed = self._routed.get(worker.worker_id)
        if routed is None or routed.heartbeat_ms != worker.heartbeat_ms:
            return _Routed(worker.heartbeat_ms)
        return routed

    def _record(self, worker: WorkerState, num_tokens: int) -> None:
        routed = self._since_heartbeat(worker)
        self._routed[worker.worker_id] = replace(routed, num_requests=routed.num_requests + 1,
                                                 num_tokens=routed.num_tokens + num_tokens)

    def _remember_prefill(self, worker_id: str) -> None:
        self._recent_prefill.append(worker_id)
        self._recent_counts[worker_id] += 1
        if len(self._recent_prefill) > self._num_recent_routes:
            oldest = self._recent_prefill.popleft()
            self._recent_counts[oldest] -= 1
            if not self._recent_counts[oldest]:
                del self._recent_counts[oldest]
