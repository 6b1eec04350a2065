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
trace). And a wait into the tail must pay: a worker whose TTFT would pass the tracked 99th percentile of the
picks' predicted TTFTs (`tail_quantile`) is left out when the wait costs this request more than the compute it saves
would cost the requests queued behind it on the quickest worker (busy / (1 - busy) of them: an M/M/1 queue at the
share of workers whose queue is longer than half a typical full prefill). On a lightly loaded pool a cached turn
stuck behind a long prompt, or a hot prefix, is then computed (copied) on a free worker instead of landing in the
tail; a busy pool still waits for the cache.
The bounds and the weight are relative (to this prompt's prefill, to the busy share), so they hold on any
hardware; only the queue's drain between heartbeats runs on the real clock (KVMESH_BALANCER_COST_SCALE fits the cost
model to the hardware, docs/balancer.md).
Picks within `tie_fraction` of the request's least prefill time of the best are spread by a hash of the request
id, so replicas that pick at the same moment do not all choose the same idle worker.

Decode: the worker with the least KV predicted for when this request's KV gets there (prefill queue + prefill + transfer
from now). With the decode workers' finished-request feed: the reported KV less the requests that left since, grown by a
token per running request per step (up to the expected output, learned from finished requests through `observe_output`,
starting from `expected_output_tokens`), plus every request assigned since from when it gets there, grown the
same way, read over a window after this request's arrival (the KV this one shares the worker with early in its life,
not at one instant). Without it: the reported KV grown and decayed by requests finishing at the rate their expected
lifetime says (expected output x step time), plus the prompts of requests assigned since that get there first.
Reports are up to a heartbeat old and staggered across workers, so aligning them to one moment matters; ties go to
fewer requests.
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
        tail_quantile: float = 0.99,
        tail_step_typical: float = 0.1,
        queued_typical: float = 0.5,
    ) -> None:
        assert 0 <= tail_quantile < 1 and tail_step_typical > 0 and queued_typical >= 0
        self.recompute_weight = recompute_weight
        self.max_wait_gap_rel = max_wait_gap_rel
        self.max_wait_gap_prefills = max_wait_gap_prefills
        self.tie_fraction = tie_fraction
        self.spread_ties = spread_ties
        self.max_extra_wait_typical = max_extra_wait_typical
        self.typical_smoothing = typical_smoothing
        self.typical_prefill_s = 0.0  # smoothed full prefill of the prompts picked for; only `pick` writes it
        self.tail_quantile = tail_quantile  # 0: no tail guard
        self.tail_step_typical = tail_step_typical  # the tracker's step, in typical full prefills
        self.tail_ttft_s = 0.0  # tracked `tail_quantile` of the picks' predicted TTFT; only `pick` writes it
        self.queued_typical = queued_typical  # the tail guard's busy share: queues past this many typical prefills

    def scores(self, ctx: PickContext, picks: dict[str, PrefillPick]) -> dict[str, float]:
        """Predicted TTFT plus the weighted compute a worker would spend beyond the best-cached one, the weight
        scaled by the share of busy workers; workers past the imbalance bound, and waits into the tail that do not
        pay (`is_tail_wait`, its busy share counting queues longer than `queued_typical` typical prefills), are
        left out."""
        least_s = min(p.predicted_s for p in picks.values())
        most_s = max(p.predicted_s for p in picks.values())
        quickest = min(picks.values(), key=lambda p: p.predicted_ttft_s)
        least_ttft = quickest.predicted_ttft_s
        bound = least_ttft * (1 + self.max_wait_gap_rel) + self.max_wait_gap_prefills * most_s
        if self.typical_prefill_s > 0:
            bound = min(bound, least_ttft + self.max_extra_wait_typical * self.typical_prefill_s)
        busy = sum(p.predicted_ttft_s > p.predicted_s for p in picks.values()) / len(picks)
        weight = self.recompute_weight * busy
        # the tail guard prices by workers with a real queue: one ending within a fraction of a typical prefill is
        # about as free as an idle one, and counted busy it made a burst's pool look saturated (M/M/1 at 1)
        queue_s = self.queued_typical * self.typical_prefill_s
        queued = sum(p.predicted_ttft_s - p.predicted_s > queue_s for p in picks.values())
        return {
            worker_id: p.predicted_ttft_s + weight * (p.predicted_s - least_s)
            for worker_id, p in picks.items()
            if p.predicted_ttft_s <= bound and not self.is_tail_wait(p, quickest, queued / len(picks))
        }

    def is_tail_wait(self, pick: PrefillPick, quickest: PrefillPick, busy: float) -> bool:
        """Whether waiting on this worker (for its cache) would put the request past the tail of recent picks'
        predicted TTFTs, saving less compute than the wait costs. The wait is this request's own; the compute it
        saves would delay the requests queued behind it on the quickest worker: about busy / (1 - busy) of them (an
        M/M/1 queue at the pool's busy share), never priced above the recompute weight."""
        if self.tail_ttft_s <= 0 or pick.predicted_ttft_s <= max(quickest.predicted_ttft_s, self.tail_ttft_s):
            return False
        price = min(busy / max(1.0 - busy, 1e-9), self.recompute_weight * busy)
        return pick.predicted_ttft_s - quickest.predicted_ttft_s > price * (quickest.predicted_s - pick.predicted_s)

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
            pick = picks[max(near, key=lambda w: spread_rank(ctx.request.request_id, w))]
        else:
            pick = picks[min(near, key=lambda w: (scores[w], ctx.view.recent_work_s(w, ctx.now_s), w))]
        self._track_tail(pick.predicted_ttft_s)
        return pick

    def _track_tail(self, ttft_s: float) -> None:
        """Stochastic quantile tracking: up by step x q above the estimate, down by step x (1 - q) below, so it
        settles where a share 1 - q of picks lies above (steps scale with the typical full prefill)."""
        if self.tail_quantile <= 0:
            return
        step = self.tail_step_typical * self.typical_prefill_s
        if ttft_s > self.tail_ttft_s:
            self.tail_ttft_s += step * self.tail_quantile
        else:
            self.tail_ttft_s = max(self.tail_ttft_s - step * (1 - self.tail_quantile), 0.0)

    def observe(self, assignment: Assignment, worker: WorkerState | None) -> None:
        pass

    def forget(self, worker_id: str) -> None:
        pass


class KvmeshDecode:
    def __init__(
        self,
        expected_output_tokens: float = 256.0,
        output_smoothing: float = 0.01,
        window_outputs: float = 0.5,
        num_samples: int = 4,
    ) -> None:
        assert expected_output_tokens > 0 and 0 < output_smoothing <= 1 and window_outputs > 0 and num_samples > 0
        self.expected_output_tokens = expected_output_tokens  # only `observe_output` writes it
        self.output_smoothing = output_smoothing
        self.window_outputs = window_outputs  # the window after the arrival, in expected outputs' steps
        self.num_samples = num_samples  # the window is read at num_samples + 1 evenly spaced moments

    def predicted_kv(self, worker: WorkerState, view: LoadView, now_s: float, arrival_s: float) -> float:
        """The worker's KV over the window after this request's KV gets there.

        Hearing finished requests (the decode workers' feed), the KV up to now is known rather than predicted: the
        report less the requests that left since. From then on every request grows a token per step (up to the
        expected output, learned from finished requests), and every request assigned since counts from when it gets
        there, with the tokens it has made by then; the prediction is the mean of that KV over a window after this
        request's arrival (`window_outputs` expected outputs' steps, `window_kv`): the KV this request will share the
        worker with early in its life, not at one instant. Without the feed, requests leave at the rate their
        expected lifetime says: the reported KV grown and decayed from the report to the arrival, plus the assigned
        requests that get there first. On the Mooncake conversation trace the feed's reading balances better
        (decode efficiency 0.948 against 0.935 at --load-basis prompt; docs/balancer.md): exact KV beats a decay
        model of it. The window took one worker per H800 node from 0.850 to 0.875, its growth to 0.879
        (docs/balancer.md)."""
        step_s = view.cost.decode_step_s(worker.num_kv_tokens)
        if view.hears_finishes:
            kvs = self.window_kv(worker, view, now_s, arrival_s, step_s)
            return sum(kvs) / len(kvs)
        lifetime_s = max(self.expected_output_tokens * step_s, 1e-3)
        elapsed_s = max(arrival_s - worker.reported_s, 0.0)
        grown = worker.num_kv_tokens + worker.num_running * min(elapsed_s / step_s, self.expected_output_tokens)
        kv = grown * math.exp(-elapsed_s / lifetime_s)
        for entry in view.pending(worker.worker_id):
            if entry.visible_s > arrival_s:
                break
            kv += entry.num_tokens * math.exp(-(arrival_s - entry.visible_s) / lifetime_s)
        return kv

    def window_kv(
        self, worker: WorkerState, view: LoadView, now_s: float, arrival_s: float, step_s: float
    ) -> list[float]:
        """With the feed: the worker's KV at `num_samples + 1` evenly spaced moments from this request's arrival to
        the window's end. The requests it runs grow a token per step from the report on; those assigned since join
        when their KV gets there, with what they have grown by then (expected outputs cap every growth)."""
        num_finished, freed = view.num_finished(worker.worker_id)
        running = max(worker.num_running - num_finished, 0)
        known = max(worker.num_kv_tokens - freed, 0)
        start_s = max(arrival_s, now_s)
        window_s = self.window_outputs * self.expected_output_tokens * step_s
        cap = self.expected_output_tokens
        kvs = []
        for j in range(self.num_samples + 1):
            at_s = start_s + window_s * j / self.num_samples
            kv = known + running * min((at_s - worker.reported_s) / step_s, cap)
            for entry in view.pending(worker.worker_id):  # by visible_s
                if entry.visible_s > at_s:
                    break
                kv += entry.num_tokens + min((at_s - entry.visible_s) / step_s, cap)
            kvs.append(kv)
        return kvs

    def pick(
        self, request: RouteRequest, workers: Sequence[WorkerState], view: LoadView, now_s: float, arrival_s: float
    ) -> str:
        return min(
            workers,
            key=lambda w: (round(self.predicted_kv(w, view, now_s, arrival_s), 3), view.num_requests(w), w.worker_id),
        ).worker_id

    def observe_output(self, num_output_tokens: int) -> None:
        self.expected_output_tokens += self.output_smoothing * (num_output_tokens - self.expected_output_tokens)
