"""PickContext: one request's facts as every policy sees them, computed once per route: which prefix each worker
holds (from the global KV index), what the store nodes could add, and the predicted prefill time on each worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mesh.routing.cost import CostModel
from mesh.routing.state import RouteRequest, WorkerState
from mesh.routing.view import LoadView


class CacheIndex(Protocol):
    """What routing reads of the global KV index (`mesh.kv_index.GlobalKVIndex`)."""

    def leading_hits_by_worker(self, block_hashes: Sequence[bytes], tier: str = "device") -> dict[str, int]: ...

    def num_leading_stored(self, block_hashes: Sequence[bytes], start: int = 0) -> tuple[int, int]: ...

    def holds(self, worker_id: str, key: bytes) -> bool: ...


@dataclass(frozen=True)
class Estimate:
    """One request on one prefill worker."""

    num_cached_tokens: int  # its own device cache holds them
    num_host_tokens: int  # the store's host tier holds the next ones
    num_ssd_tokens: int  # then the store's SSD tier
    num_uncached_tokens: int  # computed
    prefill_s: float  # fetch + compute, in the cost model's seconds (x the view's time scale: real seconds)


@dataclass
class PickContext:
    request: RouteRequest
    now_s: float
    view: LoadView
    index: CacheIndex
    include_pending: bool = False  # count blocks the worker will hold once its queue is computed (PendingCache)
    _device_blocks: dict[str, int] | None = field(default=None, repr=False)
    _stored: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)  # device blocks -> (host, ssd)
    _estimates: dict[str, Estimate] = field(default_factory=dict, repr=False)

    @property
    def cost(self) -> CostModel:
        return self.view.cost

    def device_blocks(self, worker_id: str) -> int:
        """The leading prompt blocks the worker holds on its device."""
        if self._device_blocks is None:
            self._device_blocks = self.index.leading_hits_by_worker(self.request.block_hashes)
        num_blocks = self._device_blocks.get(worker_id, 0)
        if not self.include_pending:
            return num_blocks
        return self.view.pending_cache.num_leading(
            worker_id, self.request.block_hashes, num_blocks, self.now_s, lambda key: self.index.holds(worker_id, key)
        )

    def estimate(self, worker: WorkerState) -> Estimate:
        known = self._estimates.get(worker.worker_id)
        if known is None:
            known = self._estimates[worker.worker_id] = self._estimate(worker)
        return known

    def _estimate(self, worker: WorkerState) -> Estimate:
        num_tokens, size = self.request.num_prompt_tokens, worker.block_size
        num_blocks = self.device_blocks(worker.worker_id)
        if num_blocks not in self._stored:
            self._stored[num_blocks] = self.index.num_leading_stored(self.request.block_hashes, num_blocks)
        host_blocks, ssd_blocks = self._stored[num_blocks]
        cached = min(num_blocks * size, num_tokens)
        host = min(host_blocks * size, num_tokens - cached)
        ssd = min(ssd_blocks * size, num_tokens - cached - host)
        new = num_tokens - cached - host - ssd
        prefill_s = (
            self.cost.fetch_s(host, "host")
            + self.cost.fetch_s(ssd, "ssd")
            + self.cost.prefill_s(cached + host + ssd, new)
        )
        return Estimate(cached, host, ssd, new, prefill_s)
