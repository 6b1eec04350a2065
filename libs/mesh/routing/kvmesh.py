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
Bounded imbalance: a worker whose TTFT exceeds the least one's x (1 + `max_wait_gap_rel`) plus `max_wait_gap_prefills`
times this prompt's full prefill is not a candidate, so a hot prefix is copied to a second worker instead of piling onto
one. Nor is a worker whose TTFT exceeds the least one's by more than `max_extra_wait_typical` typical full prefills
(smoothed over the prompts picked for): a conversation's turn cached on a worker busy with a very long prompt is
computed elsewhere instead of waiting seconds to save less (these waits were the p99 on the Mooncake conversation
trace). The bounds and the weight are relative (to this prompt's prefill, to the busy share), so they hold on any
hardware; only the queue's drain between heartbeats runs on the real clock (KVMESH_BALANCER_COST_SCALE fits the cost
model to the hardware, docs/balancer.md).
Picks within `tie_fraction` of the request's least prefill time of the best are spread by a hash of the request
id, so replicas that pick at the same moment do not all choose the same idle worker.

Decode: the worker with the least KV predicted for when this request's KV gets there (prefill queue + prefill + transfer
from now). With the decode workers' finished-request feed: the reported KV less the requests that left since, grown by a
token per running request per step (up to the expected output, learned from finished requests through `observe_output`,
starting from `expected_output_tokens`), plus the prompts of every request assigned since, each for the share of a
window after this request's arrival that it will be there (the KV this one shares the worker with early in its life, not
at one instant). Without it: the reported KV grown and decayed by requests finishing at the rate their expected lifetime
says (expected output x step time), plus the prompts of requests assigned since that get there first. Reports are up to
a heartbeat old and staggered across workers, so aligning them to one moment matters; ties go to fewer requests.
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
        max_extra_wait_typical: float = 8.0,
        typical_smoothing: float = 0.01,
    ) -> None:
        self.recompute_weight = recompute_weight
        self.max_wait_gap_rel = max_wait_gap_rel
        self.max_wait_gap_prefills = max_wait_gap_prefills
        self.tie_fraction = tie_fraction
        self.spread_ties = spread_ties
        self.max_extra_wait_typical = max_extra_wait_typical
        self.typical_smoothing = typical_smoothing
        self.typical_prefill_s = 0.0  # smoothed full prefill of the prompts picked for; only `pick` writes it

    def scores(self, ctx: PickContext, picks: dict[str, PrefillPick]) -> dict[str, float]:
        """Predicted TTFT plus the weighted compute a worker would spend beyond the best-cached one, the weight
        scaled by the share of busy workers; workers past the imbalance bound are left out."""
        least_s = min(p.predicted_s for p in picks.values())
        most_s = max(p.predicted_s for p in picks.values())
        least_ttft = min(p.predicted_ttft_s for p in picks.values())
        bound = least_ttft * (1 + self.max_wait_gap_rel) + self.max_wait_gap_prefills * most_s
        if self.typical_prefill_s > 0:
            bound = min(bound, least_ttft + self.max_extra_wait_typical * self.typical_prefill_s)
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
        most_s = max(p.predicted_s for p in picks.values())
        smoothing = self.typical_smoothing if self.typical_prefill_s > 0 else 1.0  # the first one as it is
        self.typical_prefill_s += smoothing * (most_s - self.typical_prefill_s)
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
    def __init__(
        self, expected_output_tokens: float = 256.0, output_smoothing: float = 0.01, window_outputs: float = 0.5
    ) -> None:
        assert expected_output_tokens > 0 and 0 < output_smoothing <= 1 and window_outputs > 0
        self.expected_output_tokens = expected_output_tokens  # only `observe_output` writes it
        self.output_smoothing = output_smoothing
        self.window_outputs = window_outputs  # the window after the arrival, in expected outputs' steps

    def predicted_kv(self, worker: WorkerState, view: LoadView, now_s: float, arrival_s: float) -> float:
        """The worker's KV when this request's KV gets there.

        Hearing finished requests (the decode workers' feed), the KV up to now is known rather than predicted: the
        report less the requests that left since, the rest grown a token per step; to the arrival it grows again, and
        every request assigned since counts with its prompt for the share of a window after this request's arrival
        (`window_outputs` expected outputs' steps) that it will be there: the KV this request will share the worker with
        early in its life, not at one instant (one arriving just after counts almost whole, one arriving past the window
        not at all). Without the feed, requests leave at the rate their expected lifetime says: the reported KV grown
        and decayed from the report to the arrival, plus the assigned requests that get there first. On the Mooncake
        conversation trace the feed's reading balances better (decode efficiency 0.948 against 0.935 at --load-basis
        prompt; docs/balancer.md): exact KV beats a decay model of it. The window took one worker per H800 node from
        0.850 to 0.878 and units from 0.952 to 0.956 (docs/balancer.md)."""
        step_s = view.cost.decode_step_s(worker.num_kv_tokens)
        if view.hears_finishes:
            known_s = max(now_s, worker.reported_s)
            num_finished, freed = view.num_finished(worker.worker_id)
            running = max(worker.num_running - num_finished, 0)
            grown_steps = min((max(arrival_s, known_s) - worker.reported_s) / step_s, self.expected_output_tokens)
            kv = max(worker.num_kv_tokens - freed, 0) + running * grown_steps
            window_s = self.window_outputs * self.expected_output_tokens * step_s
            start_s = max(arrival_s, now_s)
            for entry in view.pending(worker.worker_id):
                kv += entry.num_tokens * max(1.0 - max(entry.visible_s - start_s, 0.0) / window_s, 0.0)
            return kv
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
