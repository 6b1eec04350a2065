"""`kvmesh bench route`: every routing policy on a trace, side by side, in the simulator (`route_sim.py`).

Load: `--load X` rescales arrivals so that the offered prefill work is X times the prefill pool's capacity. The
offered work is what the trace needs computed at the least: its prompts less what an unlimited single cache would
hold (`ideal` basis, the default), priced by the cost model; `--load-basis prompt` prices whole prompts instead.
A policy that caches less than the ideal therefore runs above X; one at X = 1 can only keep up by caching ideally.

`ttft_p99_floor_s` (the same for every policy) is the p99 of what TTFT would be with no queue at all and every
prompt's ideally cached prefix already on its worker: the compute alone. No policy's p99 can be below it, so it
bounds how many times better than another policy's a p99 can be.

Goodput: the highest request rate at which 90% of requests meet both `ttft_slo_s` and `tpot_slo_s`, found by
bracketing the load geometrically from `--load` and then bisecting (the rate is the requests over the rescaled
trace's span).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from kvmesh.bench.route_sim import SimConfig, SimResult, simulate
from kvmesh.bench.route_trace import TraceRequest, ideal_hit_rate, ideal_leading_hits, load_trace, rescaled
from mesh.routing import POLICIES, CostModel, check_policy

GOODPUT_ATTAINMENT = 0.9
FIELDS = (
    "hit_rate",
    "ideal_hit_rate",
    "prefill_imbalance",
    "decode_efficiency",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "goodput",
    "ttft_p99_floor_s",
)


@dataclass(frozen=True)
class BenchConfig:
    trace: str
    limit: int | None = None
    load: float = 0.8
    load_basis: str = "ideal"  # ideal | prompt
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    num_bisections: int = 4
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        if not self.load > 0:
            raise ValueError(f"--load must be positive, got {self.load}")
        if self.load_basis not in ("ideal", "prompt"):
            raise ValueError(f"--load-basis must be ideal or prompt, got {self.load_basis!r}")


@functools.lru_cache(maxsize=4)
def _trace(path: str, limit: int | None) -> tuple[TraceRequest, ...]:
    return tuple(load_trace(path, limit))


def compute_s(
    requests: Sequence[TraceRequest], cost: CostModel, block_tokens: int, basis: str = "ideal"
) -> list[float]:
    """Each request's prefill seconds alone: its prompt less its ideally cached prefix (or the whole prompt)."""
    hits = ideal_leading_hits(requests) if basis == "ideal" else [0] * len(requests)
    seconds = []
    for num_hits, request in zip(hits, requests, strict=True):
        cached = min(num_hits * block_tokens, request.num_prompt_tokens)
        seconds.append(cost.prefill_s(cached, request.num_prompt_tokens - cached))
    return seconds


def ttft_floor_p99_s(requests: Sequence[TraceRequest], cost: CostModel, block_tokens: int) -> float:
    """p99 of the compute-only TTFT: each prompt less its ideally cached prefix, no queue, no transfer."""
    return percentile(compute_s(requests, cost, block_tokens), 0.99)


def offered_work_s(requests: Sequence[TraceRequest], cost: CostModel, basis: str, block_tokens: int) -> float:
    """Prefill seconds the trace offers: every prompt less its ideally cached prefix (or whole prompts)."""
    return sum(compute_s(requests, cost, block_tokens, basis))


@dataclass(frozen=True)
class LoadScale:
    """The trace at any load: arrivals stretched by `factor_at_1 / load`."""

    requests: Sequence[TraceRequest]
    factor_at_1: float

    @classmethod
    def of(cls, requests: Sequence[TraceRequest], config: BenchConfig) -> LoadScale:
        span = requests[-1].arrival_s - requests[0].arrival_s
        if span <= 0:
            raise ValueError("the trace's arrivals span no time: nothing to rescale")
        work = offered_work_s(requests, config.sim.cost, config.load_basis, config.sim.block_tokens)
        return cls(requests, work / config.sim.num_prefill / span)

    def at(self, load: float) -> list[TraceRequest]:
        return rescaled(self.requests, self.factor_at_1 / load)

    def rate(self, load: float) -> float:
        """Requests per second at `load`."""
        span = (self.requests[-1].arrival_s - self.requests[0].arrival_s) * self.factor_at_1 / load
        return len(self.requests) / span


def attainment(result: SimResult, config: BenchConfig) -> float:
    met = sum(
        ttft <= config.ttft_slo_s and (tpot is None or tpot <= config.tpot_slo_s)
        for ttft, tpot in zip(result.ttft_s, result.tpot_s, strict=True)
    )
    return met / max(len(result.ttft_s), 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(result: SimResult, ideal: float) -> dict[str, float]:
    busy = result.prefill_busy_s
    mean_busy = sum(busy) / len(busy)
    tpots = [t for t in result.tpot_s if t is not None]
    ttfts = result.ttft_s
    return {
        "hit_rate": round(result.num_hit_blocks / max(result.num_blocks, 1), 4),
        "ideal_hit_rate": round(ideal, 4),
        "prefill_imbalance": round(max(busy) / mean_busy, 4) if mean_busy > 0 else 1.0,
        "decode_efficiency": round(result.decode_efficiency, 4),
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 4),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "tpot_p50_s": round(percentile(tpots, 0.5), 4) if tpots else 0.0,
    }


def goodput(policy: str, scale: LoadScale, config: BenchConfig, first: SimResult) -> float:
    """Requests/s at the highest load that still meets the SLOs for 90% of requests (0.0 if none tried does)."""

    def meets(load: float) -> bool:
        return attainment(simulate(scale.at(load), policy, config.sim), config) >= GOODPUT_ATTAINMENT

    passing, failing = (config.load, None) if attainment(first, config) >= GOODPUT_ATTAINMENT else (None, config.load)
    while passing is None:  # bracket downwards
        assert failing is not None
        if failing < 1e-3:
            return 0.0
        passing, failing = (failing / 1.5, None) if meets(failing / 1.5) else (None, failing / 1.5)
    while failing is None:  # bracket upwards
        if passing > 16:
            return round(scale.rate(passing), 3)
        passing, failing = (passing * 1.5, None) if meets(passing * 1.5) else (passing, passing * 1.5)
    for _ in range(config.num_bisections):
        middle = math.sqrt(passing * failing)
        passing, failing = (middle, failing) if meets(middle) else (passing, middle)
    return round(scale.rate(passing), 3)


def run_policy(policy: str, config: BenchConfig, with_series: bool = False) -> dict[str, Any]:
    """One policy's fields (and, for plots, its TTFTs and load series)."""
    requests = _trace(config.trace, config.limit)
    scale = LoadScale.of(requests, config)
    result = simulate(scale.at(config.load), policy, replace(config.sim, record_series=with_series))
    fields: dict[str, Any] = summary(result, ideal_hit_rate(requests))
    fields["goodput"] = goodput(policy, scale, config, result)
    fields["ttft_p99_floor_s"] = round(ttft_floor_p99_s(requests, config.sim.cost, config.sim.block_tokens), 4)
    extra = (
        {
            "ttft_s": result.ttft_s,
            "series_s": result.series_s,
            "prefill_queue": result.prefill_queue_series,
            "decode_kv": result.decode_kv_series,
        }
        if with_series
        else {}
    )
    return {"fields": fields, **extra}


def run_route_bench(policy: str, config: BenchConfig, plot_dir: str | None = None, jobs: int = 1) -> dict[str, Any]:
    names = list(POLICIES) if policy == "all" else [check_policy(policy)]
    _trace(config.trace, config.limit)  # fail early on a bad trace, in this process
    with_series = plot_dir is not None
    if jobs > 1 and len(names) > 1:
        with ProcessPoolExecutor(max_workers=min(jobs, len(names))) as pool:
            runs = list(pool.map(run_policy, names, [config] * len(names), [with_series] * len(names)))
    else:
        runs = [run_policy(name, config, with_series) for name in names]
    by_policy = dict(zip(names, runs, strict=True))
    if plot_dir is not None:
        from kvmesh.bench.route_plot import plot_all

        plot_all(by_policy, plot_dir, config)
    if policy != "all":
        return dict(by_policy[names[0]]["fields"])
    return {name: run["fields"] for name, run in by_policy.items()}
