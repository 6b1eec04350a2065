"""Latency-based outlier ejection, as Envoy and Linkerd apply it to a slow endpoint: a decode worker whose recent
inter-token latency (ITL) is many times its pool's is taken out of routing for a while, though every call to it
succeeds (mesh.outliers ejects for failed calls and health checks only).

The samples are the gateway's: it times the gaps between the token batches of every stream it follows (a batch of
n tokens after a gap of t is one sample of t/n, for that decode worker and model). The gateway sees every stream,
and a worker that is starved, throttled or stopped cannot report honestly on itself: its own step times and
heartbeats stall with it.

The rule, per pool (the decode workers of one model):

- a worker's ITL is its streams' time per token over the last `window_s` seconds: the gaps' sum over the tokens'
  sum (a mean weighted by tokens, which is what TPOT is), once it has `min_samples` samples. Not their median: a
  throttled worker (runs 50 ms, stopped 150 ms) gives quick gaps and long ones in nearly equal numbers, and their
  median falls on either side by chance, while its streams really are 4x slower;
- its reference is the median of the ITLs of the pool's *other* workers that are live, not ejected and have
  enough samples. Comparing with the others keeps a slow worker from raising its own bar: with two workers, a
  median over the whole pool would sit halfway to the slow one;
- an ITL over `factor` x the reference, and over `min_itl_s` (below it the gaps measure the gateway's own event
  loop, not the worker), in both halves of the window (each with half of `min_samples`), ejects the worker: a
  burst shorter than half the window (a cold start's first steps, a moment of CPU starvation on a busy host)
  ejects nobody, a worker slow for longer is out. A reference needs another worker left in the pool, so the
  pool's last worker is never ejected (Envoy's `max_ejection_percent`);
- an ejected worker is back after `ejection_s` x the times it was ejected in a row (Envoy's ejection time, capped
  at MAX_EJECTION_MULTIPLE); samples are neither kept nor taken while it is out, so it is judged again on fresh
  ones. Judged not slow on `min_samples` fresh samples, its count of ejections in a row starts over.

All times are the caller's monotonic clock (`now_s`), so the rule is deterministic under test.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

MAX_EJECTION_MULTIPLE = 10  # a worker ejected again and again stays out at most this many ejection_s
MAX_SAMPLES = 512  # per worker and pool: the window's newest; bounds the memory and each mean's cost
CHECK_INTERVAL_S = 0.05  # a worker is judged at most this often (its samples may come thousands a second)


@dataclass(frozen=True)
class LatencyRule:
    """When a decode worker is slow enough to eject (the gateway's settings `slow_decode_*` build it)."""

    factor: float = 3.0  # ITL over factor x the pool's ejects; 0: never
    window_s: float = 5.0  # samples older than this are forgotten
    min_samples: int = 8  # fewer in the window: the worker (or a reference) is not judged
    ejection_s: float = 10.0  # the first ejection's length; each one in a row adds as much
    min_itl_s: float = 0.005  # an ITL below this is never slow

    def __post_init__(self) -> None:
        if self.factor != 0 and self.factor <= 1:
            raise ValueError(f"factor={self.factor}: must be over 1 (0: never eject for latency)")
        for name in ("window_s", "ejection_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        if self.min_samples < 1:
            raise ValueError(f"min_samples={self.min_samples}: must be at least 1")
        if self.min_itl_s < 0:
            raise ValueError(f"min_itl_s={self.min_itl_s}: must not be negative")

    @property
    def is_enabled(self) -> bool:
        return self.factor > 0


@dataclass(frozen=True)
class Ejection:
    """A worker just ejected for latency: why, and until when."""

    pool: str
    worker_id: str
    itl_s: float  # its time per token over the window
    reference_s: float  # the median of the other workers'
    until_s: float  # monotonic
    num_in_a_row: int


class LatencyOutlierDetector:
    """ITL samples and ejections per (pool, worker). One writer: the gateway's streams, on its event loop (reads
    drop ejections whose time is over). `live_workers(pool)`: the pool's workers that may serve now (the registry's,
    failed ones out); references are taken over these only."""

    def __init__(self, rule: LatencyRule, live_workers: Callable[[str], Collection[str]]) -> None:
        self.rule = rule
        self.live_workers = live_workers
        # -> (at_s, gap_s, num_tokens), oldest first
        self._samples: dict[tuple[str, str], deque[tuple[float, float, int]]] = {}
        self._ejected_until: dict[tuple[str, str], float] = {}  # monotonic; expired entries are dropped when read
        self._num_in_a_row: dict[tuple[str, str], int] = {}
        self._next_check_s: dict[tuple[str, str], float] = {}
        self.num_ejections = 0  # since start

    def record(self, pool: str, worker_id: str, gap_s: float, now_s: float, num_tokens: int = 1) -> Ejection | None:
        """`num_tokens` of `worker_id` arrived `gap_s` after their stream's previous ones (one sample); the
        Ejection when it made the worker an outlier."""
        key = (pool, worker_id)
        if not self.rule.is_enabled or self.is_ejected(pool, worker_id, now_s):
            return None
        samples = self._samples.setdefault(key, deque(maxlen=MAX_SAMPLES))
        samples.append((now_s, gap_s, num_tokens))
        if now_s < self._next_check_s.get(key, 0.0):
            return None
        self._next_check_s[key] = now_s + CHECK_INTERVAL_S
        return self.judge(pool, worker_id, now_s)

    def judge(self, pool: str, worker_id: str, now_s: float) -> Ejection | None:
        """Eject `worker_id` if it is an outlier now (`record` calls this at most every CHECK_INTERVAL_S)."""
        itl_s = self.itl_s(pool, worker_id, now_s)
        reference_s = self.reference_s(pool, worker_id, now_s)
        if itl_s is None or reference_s is None:
            return None
        key = (pool, worker_id)
        if itl_s <= self.rule.factor * reference_s or itl_s <= self.rule.min_itl_s:
            self._num_in_a_row.pop(key, None)  # judged healthy on enough fresh samples
            return None
        if not self._is_slow_throughout(key, reference_s, now_s):
            return None
        num_in_a_row = self._num_in_a_row.get(key, 0) + 1
        self._num_in_a_row[key] = num_in_a_row
        until_s = now_s + self.rule.ejection_s * min(num_in_a_row, MAX_EJECTION_MULTIPLE)
        self._ejected_until[key] = until_s
        self._samples.pop(key, None)
        self.num_ejections += 1
        return Ejection(pool, worker_id, itl_s, reference_s, until_s, num_in_a_row)

    def _is_slow_throughout(self, key: tuple[str, str], reference_s: float, now_s: float) -> bool:
        """Slow in each half of the window, on at least half of min_samples in each (the caller trimmed it)."""
        middle_s = now_s - self.rule.window_s / 2
        samples = self._samples[key]
        halves = ([s for s in samples if s[0] < middle_s], [s for s in samples if s[0] >= middle_s])
        bar_s = max(self.rule.factor * reference_s, self.rule.min_itl_s)
        need = (self.rule.min_samples + 1) // 2
        return all(len(half) >= need and time_per_token(half) > bar_s for half in halves)

    def itl_s(self, pool: str, worker_id: str, now_s: float) -> float | None:
        """The worker's time per token over the window; None with fewer than min_samples samples."""
        samples = self._samples.get((pool, worker_id))
        if samples is None:
            return None
        while samples and samples[0][0] < now_s - self.rule.window_s:
            samples.popleft()
        if len(samples) < self.rule.min_samples:
            return None
        return time_per_token(samples)

    def reference_s(self, pool: str, worker_id: str, now_s: float) -> float | None:
        """The median ITL of the pool's other live, admitted workers with enough samples; None if there is none."""
        others = [
            itl
            for other in self.live_workers(pool)
            if other != worker_id
            and not self.is_ejected(pool, other, now_s)
            and (itl := self.itl_s(pool, other, now_s)) is not None
        ]
        return statistics.median(others) if others else None

    def is_ejected(self, pool: str, worker_id: str, now_s: float) -> bool:
        key = (pool, worker_id)
        until_s = self._ejected_until.get(key)
        if until_s is None:
            return False
        if now_s < until_s:
            return True
        del self._ejected_until[key]  # its time is over: admitted again, to be judged on fresh samples
        return False

    def ejected_ids(self, pool: str, now_s: float) -> list[str]:
        """The pool's workers out for latency now, in id order."""
        return sorted(w for p, w in list(self._ejected_until) if p == pool and self.is_ejected(p, w, now_s))

    def forget(self, worker_id: str) -> None:
        """The worker left for good: nothing is kept of it, in any pool."""
        for table in (self._samples, self._ejected_until, self._num_in_a_row, self._next_check_s):
            for key in [k for k in table if k[1] == worker_id]:
                del table[key]


def time_per_token(samples: Iterable[tuple[float, float, int]]) -> float:
    """The gaps' sum over the tokens' sum of (at_s, gap_s, num_tokens) samples."""
    total_s = num_tokens = 0.0
    for _, gap_s, n in samples:
        total_s += gap_s
        num_tokens += n
    return total_s / num_tokens
