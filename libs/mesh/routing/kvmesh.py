"""kvmesh's own policy (the default).

Prefill: the worker with the least predicted time to first token, TTFT = the queue ahead of it (reported queue at
the report's time, drained since, plus what was assigned since) + fetching what the store nodes hold past its own
cached prefix + computing the rest (`CostModel.prefill_s`: attention makes deep tokens dearer). Cached blocks are
credited by where they are: free on the worker's device, priced at the tier's bandwidth in the store.
Bounded imbalance: workers that would overshoot the least loaded one by more than `max_wait_gap_s` are not
candidates, so a hot prefix is copied to a second worker rather than piling onto the one that holds it.
Ties (typically idle workers none of which holds the prefix) go to the worker with the least recent work, which
keeps busy time even over the long run.

Decode: the worker whose KV is predicted to stay lowest while the request runs. A worker's KV grows by one token
per running request per step until the request ends, so over the new request's lifetime its mean KV is about
KV now + requests x expected remaining output / 2 + the new request's prompt; the expected output is learned from
finished requests (`observe_output`), starting from `expected_output_tokens`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from mesh.routing.context import PickContext
from mesh.routing.prefill import make_pick
from mesh.routing.state import Assignment, PrefillPick, RouteRequest, WorkerState
from mesh.routing.view import LoadView


def spread_rank(request_id: str, worker_id: str) -> bytes:
    """A per-request order of workers: replicas that pick at the same moment spread their near-ties apart."""
    return hashlib.blake2b(f"{request_id}\0{worker_id}".encode(), digest_size=8).digest()


class KvmeshPrefill:
    def __init__(self, recompute_weight: float = 30.0, max_wait_gap_s: float = 2.0, max_wait_gap_rel: float = 1.0,
                 tie_s: float = 0.05, spread_ties: bool = True) -> None:
        self.recompute_weight = recompute_weight
        self.max_wait_gap_s = max_wait_gap_s
        self.max_wait_gap_rel = max_wait_gap_rel
        self.tie_s = tie_s
        self.spread_ties = spread_ties

    def scores(self, ctx: PickContext, picks: dict[str, PrefillPick]) -> dict[str, float]:
        """Predicted TTFT plus the weighted compute a worker would spend beyond the best-cached one; workers past
        the imbalance bound are left out."""
        least_s = min(p.predicted_s for p in picks.values())
        least_ttft = min(p.predicted_ttft_s for p in picks.values())
        bound = least_ttft * (1 + self.max_wait_gap_rel) + self.max_wait_gap_s
        return {worker_id: p.predicted_ttft_s + self.recompute_weight * (p.predicted_s - least_s)
                for worker_id, p in picks.items() if p.predicted_ttft_s <= bound}

    def pick(self, ctx: PickContext, workers: Sequence[WorkerState]) -> PrefillPick:
        picks = {w.worker_id: make_pick(ctx, w) for w in workers}
        scores = self.scores(ctx, picks)
        best = min(scores.values())
        near = sorted(worker_id for worker_id, score in scores.items() if score <= best + self.tie_s)
        if self.spread_ties and ctx.request.request_id:
            return picks[max(near, key=lambda w: spread_rank(ctx.request.request_id, w))]
        return picks[min(near, key=lambda w: (scores[w], ctx.view.recent_work_s(w, ctx.now_s), w))]

    def observe(self, assignment: Assignment, worker: WorkerState | None) -> None:
        pass

    def forget(self, worker_id: str) -> None:
        pass


class KvmeshDecode:
    def __init__(self, expected_output_tokens: float = 256.0, output_smoothing: float = 0.01) -> None:
        assert expected_output_tokens > 0 and 0 < output_smoothing <= 1
        self.expected_output_tokens = expected_output_tokens  # only `observe_output` writes it
        self.output_smoothing = output_smoothing

    def predicted_kv(self, worker: WorkerState, view: LoadView, arrival_s: float) -> float:
        """The worker's KV when this request's KV gets there: the reported KV, of which requests leave at the rate
        their expected lifetime says, plus the requests assigned since that get there first."""
        step_s = view.cost.decode_step_s(worker.num_kv_tokens)
        lifetime_s = max(self.expected_output_tokens * step_s, 1e-3)
        kv = worker.num_kv_tokens * math.exp(-max(arrival_s - worker.reported_s, 0.0) / lifetime_s)
        for visible_s, num_tokens, _ in view.pending(worker.worker_id):
            if visible_s > arrival_s:
                break
            kv += num_tokens * math.exp(-(arrival_s - visible_s) / lifetime_s)
        return kv

    def pick(self, request: RouteRequest, workers: Sequence[WorkerState], view: LoadView, now_s: float,
             arrival_s: float) -> str:
        return min(workers, key=lambda w: (self.predicted_kv(w, view, arrival_s), w.worker_id)).worker_id

    def observe_output(self, num_output_tokens: int) -> None:
        self.expected_output_tokens += self.output_smoothing * (num_output_tokens - self.expected_output_tokens)
