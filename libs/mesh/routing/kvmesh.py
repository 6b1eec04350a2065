"""kvmesh's own policy (the default).

Prefill: each worker's predicted time to first token, TTFT = the queue ahead of it (the reported queue, priced by
the predictions of the requests it holds, drained since the report, plus what was assigned since) + fetching what
the store nodes hold past the worker's own cached prefix + computing the rest (`CostModel.prefill_s`: attention
makes deep tokens dearer). A worker's cache is what the index says plus what it was sent and is still computing
(the router's PendingCache), so a conversation's next turn finds its previous one even while it is queued.
The pick minimises TTFT + `recompute_weight` x (the share of workers that are busy) x the compute a worker
spends beyond the best-cached one: computing a prefix again costs the pool that time when it is busy, and splits
a conversation's cache for its later turns, so a busy pool waits for a cache rather than recompute it; an idle
one just starts (measured on the Mooncake conversation trace, see docs/balancer.md).
Bounded imbalance: a worker whose TTFT exceeds the least one's x (1 + `max_wait_gap_rel`) plus
`max_wait_gap_prefills` times this prompt's full prefill is not a candidate, so a hot prefix is copied to a
second worker instead of piling onto one. The bound and the weight are relative (to this prompt's prefill, to the
busy share), so they hold on any hardware; only the queue's drain between heartbeats runs on the real clock
(KVMESH_BALANCER_COST_SCALE fits the cost model to the hardware, docs/balancer.md).
Picks within `tie_fraction` of the request's least prefill time of the best are spread by a hash of the request
id, so replicas that pick at the same moment do not all choose the same idle worker.

Decode: the worker with the least KV predicted for when this request's KV gets there (prefill queue + prefill +
transfer from now). With the decode workers' finished-request feed: the reported KV less the requests that left
since, grown by a token per running request per step (up to the expected output, learned from finished requests
through `observe_output`, starting from `expected_output_tokens`), plus the prompts of every request assigned
since. Without it: the reported KV grown and decayed by requests finishing at the rate their expected lifetime
says (expected output x step time), plus the prompts of requests assigned since that get there first. Reports are
up to a heartbeat old and staggered across workers, so aligning them to one moment matters; ties go to fewer
requests.
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
    def __init__(
        self,
        recompute_weight: float = 30.0,
        max_wait_gap_rel: float = 1.0,
        max_wait_gap_prefills: float = 4.0,
        tie_fraction: float = 0.01,
        spread_ties: bool = True,
    ) -> None:
        self.recompute_weight = recompute_weight
        self.max_wait_gap_rel = max_wait_gap_rel
        self.max_wait_gap_prefills = max_wait_gap_prefills
        self.tie_fraction = tie_fraction
        self.spread_ties = spread_ties

    def scores(self, ctx: PickContext, picks: dict[str, PrefillPick]) -> dict[str, float]:
        """Predicted TTFT plus the weighted compute a worker would spend beyond the best-cached one, the weight
        scaled by the share of busy workers; workers past the imbalance bound are left out."""
        least_s = min(p.predicted_s for p in picks.values())
        most_s = max(p.predicted_s for p in picks.values())
        least_ttft = min(p.predicted_ttft_s for p in picks.values())
        bound = least_ttft * (1 + self.max_wait_gap_rel) + self.max_wait_gap_prefills * most_s
        busy = sum(p.predicted_ttft_s > p.predicted_s for p in picks.values()) / len(picks)
        weight = self.recompute_weight * busy
        return {
            worker_id: p.predicted_ttft_s + weight * (p.predicted_s - least_s)
            for worker_id, p in picks.items()
            if p.predicted_ttft_s <= bound
        }

    def pick(self, ctx: PickContext, workers: Sequence[WorkerState]) -> PrefillPick:
        picks = {w.worker_id: make_pick(ctx, w) for w in workers}
        scores = self.scores(ctx, picks)
        best = min(scores.values())
        tie_s = self.tie_fraction * min(p.predicted_s for p in picks.values())
        near = sorted(worker_id for worker_id, score in scores.items() if score <= best + tie_s)
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

    def predicted_kv(self, worker: WorkerState, view: LoadView, now_s: float, arrival_s: float) -> float:
        """The worker's KV when this request's KV gets there.

        Hearing finished requests (the decode workers' feed), the KV up to now is known rather than predicted:
        the report less the requests that left since, the rest grown a token per step; to the arrival it grows
        again, and every request assigned since counts with its prompt, whenever it gets there (they will all be
        on it together). Without the feed, requests leave at the rate their expected lifetime says: the reported
        KV grown and decayed from the report to the arrival, plus the assigned requests that get there first.
        On the Mooncake conversation trace the feed's reading balances better (decode efficiency 0.948 against
        0.935 at --load-basis prompt; docs/balancer.md): exact KV beats a decay model of it."""
        step_s = view.cost.decode_step_s(worker.num_kv_tokens)
        if view.hears_finishes:
            known_s = max(now_s, worker.reported_s)
            num_finished, freed = view.num_finished(worker.worker_id)
            running = max(worker.num_running - num_finished, 0)
            grown_steps = min((max(arrival_s, known_s) - worker.reported_s) / step_s, self.expected_output_tokens)
            kv = max(worker.num_kv_tokens - freed, 0) + running * grown_steps
            return kv + sum(entry.num_tokens for entry in view.pending(worker.worker_id))
        lifetime_s = max(self.expected_output_tokens * step_s, 1e-3)
        elapsed_s = max(arrival_s - worker.reported_s, 0.0)
        grown = worker.num_kv_tokens + worker.num_running * min(elapsed_s / step_s, self.expected_output_tokens)
        kv = grown * math.exp(-elapsed_s / lifetime_s)
        for entry in view.pending(worker.worker_id):
            if entry.visible_s > arrival_s:
                break
            kv += entry.num_tokens * math.exp(-(arrival_s - entry.visible_s) / lifetime_s)
        return kv

    def pick(
        self, request: RouteRequest, workers: Sequence[WorkerState], view: LoadView, now_s: float, arrival_s: float
    ) -> str:
        return min(
            workers,
            key=lambda w: (round(self.predicted_kv(w, view, now_s, arrival_s), 3), view.num_requests(w), w.worker_id),
        ).worker_id

    def observe_output(self, num_output_tokens: int) -> None:
        self.expected_output_tokens += self.output_smoothing * (num_output_tokens - self.expected_output_tokens)
