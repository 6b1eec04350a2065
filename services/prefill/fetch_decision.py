"""Fetch or recompute: whether reading a cached prefix from the KV store beats computing it again, per request.

The store is not free: a read pays the store's latency plus the bytes over the lane, while the engine computes a
short prefix in less than that on a fast accelerator, or a long one in more than that on a slow CPU. So instead of
assuming, prefill measures both and decides per request (`FetchPlanner.decide`), for the blocks the store holds
after the engine's own cached prefix:

  fetch f leading blocks, compute the rest:
    whole-block read (before admission):  TTFT(f) = read(f) + queue + compute(rest)
    layer-major stream (with the compute): TTFT(f) = max(queue + compute(rest), read(f) + compute(rest) / layers)
  read(f) = latency + f x block bytes / bandwidth;  compute(n) = fixed + n x seconds per token

and picks the f in 0..n with the least predicted TTFT (ties: more fetched, which spares the engine the work).
With the stream the read overlaps the queue and the compute, so fetching part of the prefix can beat both ends:
the engine computes the tail while the head arrives. Both rates are fitted from what this worker measured
(`RateFit`: recent reads, recent requests that computed without a store read); until one has been measured its
prior stands. Since a worker that stops reading would stop measuring the store, one read is made
(`probe`) when the last is older than `probe_interval_s`.

`KVMESH_KV_FETCH` forces a side (`always`: every stored block, the mesh's behaviour before; `never`: compute)
for comparisons. One writer: the Prefiller, on the event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FETCH_MODES = ("auto", "always", "never")


@dataclass
class RateFit:
    """seconds = fixed_s + per_unit_s x units, fitted by least squares over recent samples (each older one weighs
    `decay` times less), so a store or an engine that slows down is seen within a few dozen requests.
    Until `min_samples` have arrived, or while they cannot separate the two terms (all the same size), the
    fixed part is the prior and only the per-unit part is fitted."""

    fixed_s: float  # the prior's, replaced by the fit
    per_unit_s: float
    decay: float = 0.9
    min_samples: int = 3
    num_samples: int = 0
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, xx, xy
    _prior_fixed_s: float = field(init=False)

    def __post_init__(self) -> None:
        self._prior_fixed_s = self.fixed_s

    def observe(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        w, x, y, xx, xy = (value * self.decay for value in self._sums)
        self._sums = [w + 1, x + units, y + seconds, xx + units * units, xy + units * seconds]
        self.num_samples += 1
        self._fit()

    def _fit(self) -> None:
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if self.num_samples >= self.min_samples and spread > 1e-9 * xx * w:
            slope = (w * xy - x * y) / spread
            fixed = (y - slope * x) / w
            if slope > 0 and fixed >= 0:
                self.fixed_s, self.per_unit_s = fixed, slope
                return
        fixed = min(self._prior_fixed_s, y / w / 2)  # the prior's, or half the mean sample when that is quicker
        self.fixed_s, self.per_unit_s = fixed, max((y - fixed * w) / x, 1e-12)

    def predict(self, units: float) -> float:
        return self.fixed_s + self.per_unit_s * units if units > 0 else 0.0


@dataclass(frozen=True)
class FetchDecision:
    """What one request does with the blocks the store holds after the engine's prefix, and why."""

    choice: str  # fetch (all) | partial (a leading part) | recompute (none) | probe | forced
    num_fetch_blocks: int  # of num_stored_blocks, the leading ones to read
    num_stored_blocks: int
    predicted_fetch_s: float  # TTFT predicted when every stored block is read
    predicted_recompute_s: float  # ... when none is
    predicted_s: float  # ... for the choice
    queue_s: float  # the engine's queue ahead, predicted
    store_latency_s: float  # the fitted read: latency + bytes / bandwidth
    store_bytes_per_s: float
    compute_tokens_per_s: float  # the fitted compute: fixed + tokens / rate

    def attributes(self) -> dict[str, str | int | float]:
        """For the request's trace span."""
        return {
            "kvmesh.kv.fetch.choice": self.choice,
            "kvmesh.kv.fetch.num_blocks": self.num_fetch_blocks,
            "kvmesh.kv.fetch.num_stored_blocks": self.num_stored_blocks,
            "kvmesh.kv.fetch.predicted_fetch_s": round(self.predicted_fetch_s, 6),
            "kvmesh.kv.fetch.predicted_recompute_s": round(self.predicted_recompute_s, 6),
            "kvmesh.kv.fetch.queue_s": round(self.queue_s, 6),
            "kvmesh.kv.fetch.store_latency_s": round(self.store_latency_s, 6),
            "kvmesh.kv.fetch.store_bytes_per_s": round(self.store_bytes_per_s),
            "kvmesh.kv.fetch.compute_tokens_per_s": round(self.compute_tokens_per_s, 1),
        }


@dataclass(frozen=True)
class FetchQuestion:
    """One request's side of the decision (the prefiller fills it)."""

    num_stored_blocks: int  # blocks the store holds right after the engine's cached prefix
    block_tokens: int
    block_bytes: int  # one block's KV, every layer
    num_layers: int
    num_new_tokens: int  # tokens to compute if nothing is fetched (prompt - engine's prefix)
    num_queued_tokens: int  # prompt tokens the engine holds but has not computed yet
    is_streamed: bool  # the read would feed the compute layer by layer


class FetchPlanner:
    """Decides per request; learns from the reads and computes the prefiller reports."""

    def __init__(
        self,
        mode: str = "auto",
        store: RateFit | None = None,
        compute: RateFit | None = None,
        probe_interval_s: float = 30.0,
        margin: float = 0.1,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in FETCH_MODES:
            raise ValueError(f"fetch mode must be one of {', '.join(FETCH_MODES)}, got {mode!r}")
        self.mode = mode
        # Priors: a local lane (2 ms, 1 GB/s) and a small engine on a CPU (20 ms, 2,000 tokens/s).
        self.store = store or RateFit(fixed_s=0.002, per_unit_s=1e-9)  # units: bytes
        self.compute = compute or RateFit(fixed_s=0.02, per_unit_s=5e-4)  # units: tokens
        self.probe_interval_s = probe_interval_s
        self.margin = margin
        self._monotonic = monotonic
        self._last_read_s = -math.inf

    def decide(self, question: FetchQuestion) -> FetchDecision:
        q = question
        queue_s = self.compute.per_unit_s * q.num_queued_tokens
        predicted = [self._ttft(q, f, queue_s) for f in range(q.num_stored_blocks + 1)]
        best = min(range(len(predicted)), key=lambda f: (predicted[f], -f))
        if predicted[best] > predicted[-1] * (1 - self.margin):  # not clearly better: fetch, sparing the engine
            best = q.num_stored_blocks
        choice = "fetch" if best == q.num_stored_blocks else "partial" if best else "recompute"
        if self.mode != "auto":
            best = q.num_stored_blocks if self.mode == "always" else 0
            choice = "forced"
        elif best < q.num_stored_blocks and self._monotonic() - self._last_read_s > self.probe_interval_s:
            best, choice = q.num_stored_blocks, "probe"
        return FetchDecision(
            choice=choice if q.num_stored_blocks else "recompute",
            num_fetch_blocks=best,
            num_stored_blocks=q.num_stored_blocks,
            predicted_fetch_s=predicted[-1],
            predicted_recompute_s=predicted[0],
            predicted_s=predicted[best],
            queue_s=queue_s,
            store_latency_s=self.store.fixed_s,
            store_bytes_per_s=1.0 / self.store.per_unit_s,
            compute_tokens_per_s=1.0 / self.compute.per_unit_s,
        )

    def _ttft(self, q: FetchQuestion, num_fetch: int, queue_s: float) -> float:
        compute_s = self.compute.predict(max(q.num_new_tokens - num_fetch * q.block_tokens, 1))
        if num_fetch == 0:
            return queue_s + compute_s
        read_s = self.store.predict(num_fetch * q.block_bytes)
        if q.is_streamed:
            return max(queue_s + compute_s, read_s + compute_s / max(q.num_layers, 1))
        return read_s + queue_s + compute_s

    def observe_read(self, num_bytes: int, seconds: float) -> None:
        """A store read that completed: its bytes and its time from start to the last byte checked."""
        self._last_read_s = self._monotonic()
        self.store.observe(num_bytes, seconds)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """A request that computed `num_tokens` in `seconds` (admission to first token, less its queue) with no
        store read in flight (a stream's wait would count as compute)."""
        self.compute.observe(num_tokens, seconds)
