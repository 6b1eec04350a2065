"""One repeat's request records -> its metrics; several repeats -> each metric's mean and t-interval.

Every metric, its unit and which way is better, is in METRICS; docs/evaluation.md defines each. A metric that
does not apply to a workload (no golden answers, no prices) is None and is left out of the summary.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.eval.client import RequestOutcome
from kvmesh.eval.stats import mean_interval

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Metric:
    unit: str
    is_higher_better: bool
    is_multiplicative: bool = False  # its noise scales with it (latencies): the gate compares it on a log scale


def _latency(name: str) -> dict[str, Metric]:
    return {f"{name}_{suffix}": Metric("ms", False, True) for suffix in (*(f"p{q}" for q in PERCENTILES), "mean")}


METRICS: dict[str, Metric] = {
    **_latency("ttft"),
    **_latency("itl"),
    **_latency("tpot"),
    **_latency("e2e"),
    **_latency("queue"),
    "request_throughput": Metric("req/s", True),
    "output_throughput": Metric("tok/s", True),
    "goodput": Metric("req/s", True),
    "goodput_ratio": Metric("fraction", True),
    "error_rate": Metric("fraction", False),
    "cached_ratio": Metric("fraction", True),
    "cost_total": Metric("$", False),
    "cost_per_1k_output": Metric("$", False),
    "golden": Metric("fraction", True),
    "checks": Metric("fraction", True),
    "tool_call_validity": Metric("fraction", True),
    "schema_validity": Metric("fraction", True),
}

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")  # --slo ttft=500ms,...: per request; itl is its worst gap


@dataclass(frozen=True)
class ModelPrice:
    """Dollars per million tokens, as in the gateway's price table (docs/tenancy.md)."""

    input_per_mtok: float
    cached_input_per_mtok: float
    output_per_mtok: float

    def cost(self, record: RequestOutcome) -> float:
        uncached = record.prompt_tokens - record.cached_tokens
        return (
            uncached * self.input_per_mtok
            + record.cached_tokens * self.cached_input_per_mtok
            + record.completion_tokens * self.output_per_mtok
        ) / 1e6


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), so p50 of [1, 2] is 1.5."""
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def tpot_s(record: RequestOutcome) -> float | None:
    """(E2E - TTFT) / (output tokens - 1), the tokens counted by the server; None under two tokens."""
    if record.ttft_s is None or record.e2e_s is None or record.completion_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)


def meets_slo(record: RequestOutcome, slo: dict[str, float]) -> bool:
    if not record.is_ok or record.ttft_s is None:
        return False
    observed = {
        "ttft": record.ttft_s,
        "tpot": tpot_s(record) or 0.0,
        "itl": max(record.gaps_s, default=0.0),
        "e2e": record.e2e_s or 0.0,
    }
    return all(observed[name] <= limit for name, limit in slo.items())


def repeat_metrics(
    records: list[RequestOutcome], duration_s: float, slo: dict[str, float], prices: dict[str, ModelPrice] | None
) -> dict[str, Any]:
    """The metrics of one repeat (latencies in ms), and its error counts by kind under "errors"."""
    ok = [r for r in records if r.is_ok and r.ttft_s is not None]
    metrics: dict[str, Any] = {name: None for name in METRICS}
    samples = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "itl": [gap for r in ok for gap in r.gaps_s],
        "tpot": [t for t in map(tpot_s, ok) if t is not None],
        "e2e": [r.e2e_s for r in ok if r.e2e_s is not None],
        "queue": [max(0.0, r.sent_s - r.scheduled_s) for r in records],
    }
    for name, values in samples.items():
        if values:
            for q in PERCENTILES:
                metrics[f"{name}_p{q}"] = percentile(values, q) * 1000
            metrics[f"{name}_mean"] = statistics.fmean(values) * 1000
    num_output = sum(r.completion_tokens for r in ok)
    num_prompt = sum(r.prompt_tokens for r in ok)
    num_good = sum(meets_slo(r, slo) for r in ok)
    metrics.update(
        request_throughput=len(ok) / duration_s,
        output_throughput=num_output / duration_s,
        goodput=num_good / duration_s,
        goodput_ratio=num_good / len(records),
        error_rate=1 - len(ok) / len(records),
        cached_ratio=sum(r.cached_tokens for r in ok) / num_prompt if num_prompt else None,
    )
    if prices is not None and all(r.model in prices for r in ok):
        metrics["cost_total"] = sum(prices[r.model].cost(r) for r in ok)
        metrics["cost_per_1k_output"] = metrics["cost_total"] / num_output * 1000 if num_output else None
    metrics.update(_quality(records))
    metrics["errors"] = dict(Counter(r.error for r in records if r.error is not None))
    return metrics


def _quality(records: list[RequestOutcome]) -> dict[str, float | None]:
    golden = [r.quality["golden"] for r in records if r.quality.get("golden") is not None]
    checks = [c for r in records for c in r.quality.get("checks", [])]

    def rate(kinds: tuple[str, ...]) -> float | None:
        chosen = [c["passed"] for c in checks if c["kind"] in kinds]
        return sum(chosen) / len(chosen) if chosen else None

    return {
        "golden": sum(golden) / len(golden) if golden else None,
        "checks": rate(("tool_call", "json_schema", "contains", "regex")),
        "tool_call_validity": rate(("tool_call",)),
        "schema_validity": rate(("json_schema",)),
    }


def summarize(repeats: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric present in every repeat: {"mean", "low", "high", "values"} (a 95% t-interval over repeats)."""
    summary = {}
    for name in METRICS:
        values = [r[name] for r in repeats]
        if any(v is None for v in values):
            continue
        mean, low, high = mean_interval(values)
        summary[name] = {"mean": mean, "low": low, "high": high, "values": values}
    return summary
