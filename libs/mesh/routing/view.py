"""LoadView: every worker's last report plus what was assigned to it since (optimistic accounting until the next
heartbeat), the picture every policy reads.

An assignment counts on a worker until a report that includes it arrives: on the prefill worker from the moment
it is assigned, on the decode worker from when its KV is expected there (`decode_arrival_s`), because the decode
worker cannot report a request still in prefill. Own and peers' assignments count the same way.

A decode worker's requests that finished since its report (the decode workers' feed, `finish`) stop counting at
once: their KV is freed now, not at the next heartbeat.

Prefill queues drain between reports: `wait_s` predicts when a worker's queue empties, starting from the reported
queue at the report's time and adding each assignment's predicted prefill time in order (as Mooncake's conductor
predicts queueing time). Assignments carry the cost model's seconds; waits are real seconds, the model's times
`time_scale`, fitted from the reports (`calibration.TimeScale`).
One writer: the Router that owns the view; policies only read it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from mesh.routing.calibration import TimeScale
from mesh.routing.cost import CostModel
from mesh.routing.pending_cache import PendingCache
from mesh.routing.state import Assignment, WorkerState

HISTORY = 256  # assignments remembered per worker after a report includes them


class Entry(NamedTuple):
    """One assignment as it counts on one worker."""

    visible_s: float  # from when a report includes it (prefill: assigned; decode: its KV expected there)
    num_tokens: int  # its prompt tokens: what a worker reports queued (a waiting request's whole prompt) or holds
    prefill_s: float  # prefill: its predicted prefill time in the cost model's seconds (decode: 0)
    num_uncached_tokens: int  # prefill: the tokens it computes (decode: 0)
    request_id: str = ""


@dataclass
class _Pending:
    """What one worker was assigned since its last report."""

    entries: deque[Entry] = field(default_factory=deque)  # by visible_s
    num_requests: int = 0
    num_tokens: int = 0  # sum of the entries' prompt tokens
    busy_until_s: float = 0.0  # prefill: when its queue is predicted to be done
    queued_s: float = 0.0  # prefill: its queue at the last report, in the cost model's seconds
    is_queue_priced: bool = False  # ... all of it priced by remembered assignments
    reported: deque[Entry] = field(default_factory=lambda: deque(maxlen=HISTORY))  # the last ones reports included
    finished: deque[tuple[float, int]] = field(default_factory=deque)  # decode: (finished_s, KV tokens freed)
    num_freed_tokens: int = 0  # sum of the finished ones' KV


class LoadView:
    def __init__(self, cost: CostModel, balance_half_life_s: float = 120.0) -> None:
        assert balance_half_life_s > 0
        self.cost = cost
        self.balance_half_life_s = balance_half_life_s
        self._reports: dict[str, WorkerState] = {}
        self._pending: dict[str, _Pending] = {}
        self._recent_work: dict[str, tuple[float, float]] = {}  # worker -> (prefill seconds assigned, as of when)
        self.pending_cache = PendingCache()  # written only by `assign` and `forget`
        self.time_scale = TimeScale()  # real seconds per predicted second of prefill; written only by `update`
        self.hears_finishes = False  # whether decode workers' finished requests reach this view (`finish`)

    # -- writes (the owning Router) -----------------------------------------------------------------------------
    def update(self, state: WorkerState) -> None:
        """A report; one not newer than the known one changes nothing."""
        known = self._reports.get(state.worker_id)
        if known is not None and state.reported_s <= known.reported_s:
            return
        self._reports[state.worker_id] = state
        pending = self._pending.setdefault(state.worker_id, _Pending())
        arrivals = []
        while pending.entries and pending.entries[0].visible_s <= state.reported_s:
            entry = pending.entries.popleft()
            pending.num_requests -= 1
            pending.num_tokens -= entry.num_tokens
            pending.reported.append(entry)
            arrivals.append((entry.visible_s, entry.prefill_s))
        while pending.finished and pending.finished[0][0] <= state.reported_s:  # the report has them freed
            pending.num_freed_tokens -= pending.finished.popleft()[1]
        queued_s, is_priced = self._queued_s(pending, state.num_queued_prompt_tokens)
        if known is not None and is_priced and pending.is_queue_priced:
            self.time_scale.observe(
                known.reported_s,
                pending.queued_s,
                arrivals,
                state.reported_s,
                queued_s,
                state.num_queued_prompt_tokens > 0,
            )
        pending.queued_s, pending.is_queue_priced = queued_s, is_priced
        scale = self.time_scale.value
        busy = state.reported_s + queued_s * scale
        for entry in pending.entries:
            busy = max(busy, entry.visible_s) + entry.prefill_s * scale
        pending.busy_until_s = busy

    def assign(self, assignment: Assignment) -> None:
        """A decision's load: on its prefill worker and its decode worker, either of which is "" with late
        binding (the route names prefill only; the binding, decode only)."""
        if assignment.prefill_worker_id:
            self._assign_prefill(assignment)
        if assignment.decode_worker_id:
            decode = self._pending.setdefault(assignment.decode_worker_id, _Pending())
            self._add(
                decode, Entry(assignment.decode_arrival_s, assignment.num_prompt_tokens, 0.0, 0, assignment.request_id)
            )

    def _assign_prefill(self, assignment: Assignment) -> None:
        prefill = self._pending.setdefault(assignment.prefill_worker_id, _Pending())
        self._add(
            prefill,
            Entry(
                assignment.assigned_s,
                assignment.num_prompt_tokens,
                assignment.prefill_s,
                assignment.num_uncached_tokens,
                assignment.request_id,
            ),
        )
        prefill.busy_until_s = (
            max(prefill.busy_until_s, assignment.assigned_s) + assignment.prefill_s * self.time_scale.value
        )
        done_s = assignment.decode_arrival_s - self.cost.transfer_s(assignment.num_prompt_tokens)
        self.pending_cache.add(assignment.prefill_worker_id, assignment.block_hashes, done_s)
        value = self.recent_work_s(assignment.prefill_worker_id, assignment.assigned_s)
        self._recent_work[assignment.prefill_worker_id] = (value + assignment.prefill_s, assignment.assigned_s)

    def finish(self, worker_id: str, request_id: str, finished_s: float, num_kv_tokens: int) -> None:
        """A request left a decode worker at `finished_s`, freeing `num_kv_tokens` of KV."""
        self.hears_finishes = True
        known = self._reports.get(worker_id)
        if known is None or finished_s <= known.reported_s:
            return  # the report already shows it gone
        pending = self._pending.setdefault(worker_id, _Pending())
        entry = next((e for e in pending.entries if e.request_id == request_id), None) if request_id else None
        if entry is not None:  # it came and went between two reports: it just stops counting
            pending.entries.remove(entry)
            pending.num_requests -= 1
            pending.num_tokens -= entry.num_tokens
            return
        if pending.finished and finished_s < pending.finished[-1][0]:  # heard out of order
            pending.finished = deque(sorted([*pending.finished, (finished_s, num_kv_tokens)]))
        else:
            pending.finished.append((finished_s, num_kv_tokens))
        pending.num_freed_tokens += num_kv_tokens

    def forget(self, worker_id: str) -> None:
        self._reports.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        self._recent_work.pop(worker_id, None)
        self.pending_cache.forget(worker_id)

    def _queued_s(self, pending: _Pending, num_tokens: int) -> tuple[float, bool]:
        """A reported queue in the cost model's seconds, and whether remembered assignments priced all of it.
        A worker serves in order, so its queue is the last requests sent to it before the report: their predicted
        times (which know each one's cached prefix and context depth) add up to it, newest first. A worker counts
        a waiting request's whole prompt and a running one's tokens left to compute, so the oldest one only partly
        covered is the running one, priced by its uncached tokens. What no remembered assignment covers goes at
        the cost model's rate for shallow tokens."""
        seconds = 0.0
        for entry in reversed(pending.reported):
            if num_tokens <= 0:
                break
            if num_tokens >= entry.num_tokens:
                seconds += entry.prefill_s
                num_tokens -= entry.num_tokens
                continue
            seconds += entry.prefill_s * min(num_tokens / max(entry.num_uncached_tokens, 1), 1.0)
            num_tokens = 0
        return seconds + self.cost.queued_s(max(num_tokens, 0)), num_tokens <= 0

    @staticmethod
    def _add(pending: _Pending, entry: Entry) -> None:
        # entries stay ordered by visibility (a peer's assignment may be heard late), so a report drops a prefix
        if pending.entries and entry.visible_s < pending.entries[-1].visible_s:
            pending.entries = deque(sorted([*pending.entries, entry], key=lambda e: e.visible_s))
        else:
            pending.entries.append(entry)
        pending.num_requests += 1
        pending.num_tokens += entry.num_tokens

    # -- reads --------------------------------------------------------------------------------------------------
    def report(self, worker_id: str) -> WorkerState | None:
        return self._reports.get(worker_id)

    def num_pending(self, worker_id: str) -> int:
        pending = self._pending.get(worker_id)
        return pending.num_requests if pending is not None else 0

    def num_pending_tokens(self, worker_id: str) -> int:
        pending = self._pending.get(worker_id)
        return pending.num_tokens if pending is not None else 0

    def num_finished(self, worker_id: str) -> tuple[int, int]:
        """Decode: requests that finished since the worker's report, and the KV tokens they freed."""
        pending = self._pending.get(worker_id)
        return (len(pending.finished), pending.num_freed_tokens) if pending is not None else (0, 0)

    def num_requests(self, worker: WorkerState) -> int:
        """Requests it holds or is about to: running + waiting + assigned since the report - finished since."""
        num_finished, _ = self.num_finished(worker.worker_id)
        return max(worker.num_running + worker.num_waiting - num_finished, 0) + self.num_pending(worker.worker_id)

    def num_queued_tokens(self, worker: WorkerState) -> int:
        """Prefill: queued prompt tokens, reported plus assigned since (whole prompts, as workers count them)."""
        return worker.num_queued_prompt_tokens + self.num_pending_tokens(worker.worker_id)

    def num_kv_tokens(self, worker: WorkerState) -> int:
        """Decode: KV tokens held, reported less what finished since, plus the prompts of requests on their way."""
        _, freed = self.num_finished(worker.worker_id)
        return max(worker.num_kv_tokens - freed, 0) + self.num_pending_tokens(worker.worker_id)

    def pending(self, worker_id: str) -> Sequence[Entry]:
        """The assignments not yet in a report, by visibility."""
        pending = self._pending.get(worker_id)
        return pending.entries if pending is not None else ()

    def wait_s(self, worker: WorkerState, now_s: float) -> float:
        """Prefill: predicted seconds until the work queued on it is done."""
        pending = self._pending.get(worker.worker_id)
        if pending is not None:
            busy_until = pending.busy_until_s
        else:
            queued_s, _ = self._queued_s(_Pending(), worker.num_queued_prompt_tokens)
            busy_until = worker.reported_s + queued_s * self.time_scale.value
        return max(busy_until - now_s, 0.0)

    def recent_work_s(self, worker_id: str, now_s: float) -> float:
        """Prefill seconds assigned to the worker, decayed with `balance_half_life_s`: its recent share of work."""
        value, at_s = self._recent_work.get(worker_id, (0.0, now_s))
        return value * math.exp2(-max(now_s - at_s, 0.0) / self.balance_half_life_s)
