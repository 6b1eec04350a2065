"""Capacity planning: how many workers each pool should have for the load it shows, published by the balancer
(`kvmesh.balancer.replicas`, and ListWorkers' `pools`) for an autoscaler to act on.

Utilization comes from heartbeats only, so it needs no calibration: a prefill or encoder worker is busy when it
reports work (running, waiting or queued prompt tokens; an encoder's images in flight), and the pool's
utilization is the smoothed share of busy reports; a decode worker's is the larger of its KV in use and its batch
slots in use. KV in use is the share of its blocks that requests hold, as the worker counts them (`kv_usage`), not
its tokens over blocks x one block size: a block's tokens are each model's own (128 for DeepSeek-V4-Flash beside
a `block_size` of 16), and a worker serving models of different block sizes reports one block count for all of
them, which no one size turns into tokens. The recommendation is the pool size that would run at
`target_utilization`: ceil(workers x utilization / target), at least 1. A saturated prefill pool (utilization 1)
therefore asks for workers / target: more than it has, until queues drain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mesh.routing.state import WorkerState


@dataclass(frozen=True)
class PoolRecommendation:
    pool: str
    num_workers: int
    num_recommended: int
    utilization: float
    target_utilization: float


def worker_utilization(pool: str, worker: WorkerState) -> float:
    if pool == "decode":
        kv = worker.kv_usage
        seqs = worker.num_running / worker.max_num_seqs if worker.max_num_seqs > 0 else 0.0
        return min(max(kv, seqs), 1.0)
    is_busy = worker.num_running > 0 or worker.num_waiting > 0 or worker.num_queued_prompt_tokens > 0
    return 1.0 if is_busy else 0.0


class CapacityPlanner:
    """One writer: `observe`, once per heartbeat interval per pool."""

    def __init__(self, target_utilization: float = 0.8, half_life_s: float = 60.0) -> None:
        if not 0 < target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {target_utilization}")
        self.target_utilization = target_utilization
        self.half_life_s = half_life_s
        self._utilization: dict[str, tuple[float, float]] = {}  # pool -> (smoothed utilization, as of when)

    def observe(self, pool: str, workers: Sequence[WorkerState], now_s: float) -> None:
        if not workers:
            return
        sample = sum(worker_utilization(pool, w) for w in workers) / len(workers)
        known = self._utilization.get(pool)
        if known is None:
            self._utilization[pool] = (sample, now_s)
            return
        value, at_s = known
        weight = 1.0 - math.exp2(-max(now_s - at_s, 0.0) / self.half_life_s)
        self._utilization[pool] = (value + weight * (sample - value), now_s)

    def recommend(self, pool: str, num_workers: int) -> PoolRecommendation:
        utilization = self._utilization.get(pool, (0.0, 0.0))[0]
        needed = math.ceil(num_workers * utilization / self.target_utilization - 1e-9)
        return PoolRecommendation(pool, num_workers, max(needed, 1), round(utilization, 4), self.target_utilization)
