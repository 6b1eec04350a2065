"""Prefill policies: which prefill worker computes a prompt. Each reads the LoadView and the global KV index through
a PickContext; those that keep state of their own (a round-robin position, an approximate tree, quotas) update it
in `observe`, which the Router calls for its own and its peers' assignments.

- `round_robin`: the next worker in id order.
- `least_load`: fewest queued prompt tokens (reported + assigned since).
- `cache_aware` (SGLang's router): while loads are balanced (max - min <= 64 requests or max <= 1.5 x min), the worker
  whose approximate prefix tree (the blocks this router sent it, LRU-bounded by its cache size) matches more than
  half the prompt, else the worker with the smallest tree (then fewest requests: trees bounded by the cache size
  fill up and tie); when imbalanced, the fewest requests.
- `kv_aware` (Dynamo's KV router): least (queued blocks + prompt blocks - cached blocks credited by tier).
- `deepseek`: prompts bucketed by context length; within a bucket, the worker with the most remaining compute quota,
  i.e. the least prefill time assigned in that bucket recently (then overall).
- `kvmesh`: least predicted time to first token (`KvmeshPrefill`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from mesh.routing.context import PickContext
from mesh.routing.cost import TIER_CREDITS
from mesh.routing.state import Assignment, PrefillPick, WorkerState


class PrefillPolicy(Protocol):
    def pick(self, ctx: PickContext, workers: Sequence[WorkerState]) -> PrefillPick: ...

    def observe(self, assignment: Assignment, worker: WorkerState | None) -> None:
        """An assignment (own or a peer's) was applied to the view."""
        ...

    def forget(self, worker_id: str) -> None: ...


def make_pick(ctx: PickContext, worker: WorkerState) -> PrefillPick:
    estimate = ctx.estimate(worker)
    prefill_s = estimate.prefill_s * ctx.view.time_scale.value
    return PrefillPick(
        worker.worker_id, estimate.num_cached_tokens, prefill_s, ctx.view.wait_s(worker, ctx.now_s) + prefill_s
    )


class _Stateless:
    def observe(self, assignment: Assignment, worker: WorkerState | None) -> None:
        pass

    def forget(self, worker_id: str) -> None:
        pass


class RoundRobinPrefill(_Stateless):
    def __init__(self) -> None:
        self._next = 0  # only `pick` writes it

    def pick(self, ctx: PickContext, workers: Sequence[WorkerState]) -> PrefillPick:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return make_pick(ctx, worker)


class LeastLoadPrefill(_Stateless):
    def pick(self, ctx: PickContext, workers: Sequence[WorkerState]) -> PrefillPick:
        return make_pick(ctx, min(workers, key=lambda w: (ctx.view.num_queued_tokens(w), w.worker_id)))


class CacheAwarePrefill:
    """SGLang's rule over an approximate tree per worker: the prompt blocks routed there (by any replica), evicted
    least recently routed first once the worker's cache size is reached. It never reads the KV index."""

    def __init__(self, balance_abs_requests: int = 64, balance_rel: float = 1.5, cache_threshold: float = 0.5) -> None:
        self.balance_abs_requests = balance_abs_requests
        self.balance_rel = balance_rel
        self.cache_threshold = cache_threshold
        self._trees: dict[str, OrderedDict[bytes, None]] = {}  # only `observe` and `forget` write them

    def pick(self, ctx: PickContext, workers: Sequence[WorkerState]) -> PrefillPick:
        loads = {w.worker_id: ctx.view.num_requests(w) for w in workers}
        low, high = min(loads.values()), max(loads.values())
        if high - low > self.balance_abs_requests and high > self.balance_rel * low:
            return make_pick(ctx, min(workers, key=lambda w: (loads[w.worker_id], w.worker_id)))
        blocks = ctx.request.block_hashes
        matched = {w.worker_id: self._num_matched(w.worker_id, blocks) for w in workers}
        best = max(workers, key=lambda w: (matched[w.worker_id], -loads[w.worker_id]))
        if blocks and matched[best.worker_id] / len(blocks) > self.cache_threshold:
            return make_pick(ctx, best)
        return make_pick(
            ctx, min(workers, key=lambda w: (len(self._trees.get(w.worker_id, ())), loads[w.worker_id], w.worker_id))
        )

    def _num_matched(self, worker_id: str, blocks: Sequence[bytes]) -> int:
        tree = self._trees.get(worker_id)
        if not tree:
            return 0
        return next((n for n, key in enumerate(blocks) if key not in tree), len(blocks))

    def observe(self, assignment: Assignment, worker: WorkerState | None) -> None:
        tree = self._trees.setdefault(assignment.prefill_worker_id, OrderedDict())
        for key in assignment.block_hashes:
            tree[key] = None
            tree.move_to_end(key)
        capacity = worker.num_kv_blocks if worker is not None and worker.num_kv_blocks > 0 else None
        while capacity is not None and len(tree) > capacity:
            tree.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self._trees.pop(worker_id, None)


class KvAwarePrefill(_Stateless):
    """Dynamo's cost in blocks: queued + this prompt's, less its cached blocks credited by tier."""

    def pick(self, ctx: PickContext, workers: Sequence[WorkerState]) -> PrefillPick:
        return make_pick(ctx, min(workers, key=lambda w: (self.cost(ctx, w), ctx.view.num_requests(w), w.worker_id)))

    @staticmethod
    def cost(ctx: PickContext, worker: WorkerState) -> float:
        estimate = ctx.estimate(worker)
        credited = (
            TIER_CREDITS["device"] * estimate.num_cached_tokens
            + TIER_CREDITS["host"] * estimate.num_host_tokens
            + TIER_CREDITS["ssd"] * estimate.num_ssd_tokens
        )
        queued = ctx.view.num_queued_tokens(worker)
        return (queued + ctx.request.num_prompt_tokens - credited) / worker.block_size


class DeepSeekPrefill:
    """Context-length buckets; each worker's compute quota per bucket is spent by the prefill seconds assigned to
    it in that bucket (decayed with `half_life_s`), so the worker with the most left is the one with the least."""

    def __init__(self, bucket_edges: Sequence[int] = (4096, 16384, 65536), half_life_s: float = 60.0) -> None:
        self.bucket_edges = tuple(bucket_edges)
        self.half_life_s = half_life_s
        self._spent: dict[tuple[str, int], tuple[float, float]] = {}  # (worker, bucket) -> (seconds, as of when)

    def bucket(self, num_prompt_tokens: int) -> int:
        return sum(num_prompt_tokens >= edge for edge in self.bucket_edges)

    def spent_s(self, worker_id: str, bucket: int, now_s: float) -> float:
        value, at_s = self._spent.get((worker_id, bucket), (0.0, now_s))
        return value * math.exp2(-max(now_s - at_s, 0.0) / self.half_life_s)

    def pick(self, ctx: PickContext, workers: Sequence[WorkerState]) -> PrefillPick:
        bucket = self.bucket(ctx.request.num_prompt_tokens)
        everything = range(len(self.bucket_edges) + 1)
        return make_pick(
            ctx,
            min(
                workers,
                key=lambda w: (
                    self.spent_s(w.worker_id, bucket, ctx.now_s),
                    sum(self.spent_s(w.worker_id, b, ctx.now_s) for b in everything),
                    w.worker_id,
                ),
            ),
        )

    def observe(self, assignment: Assignment, worker: WorkerState | None) -> None:
        key = (assignment.prefill_worker_id, self.bucket(assignment.num_prompt_tokens))
        spent = self.spent_s(key[0], key[1], assignment.assigned_s)
        self._spent[key] = (spent + assignment.prefill_s, assignment.assigned_s)

    def forget(self, worker_id: str) -> None:
        for key in [k for k in self._spent if k[0] == worker_id]:
            del self._spent[key]
