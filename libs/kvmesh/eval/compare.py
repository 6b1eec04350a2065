"""The gate: a result against a baseline, metric by metric, each against its allowed regression.

A metric regressed when (1) its change for the worse is beyond the threshold and (2) Welch's 95% interval of the
change lies wholly on the worse side of no change: a difference the repeats cannot tell from noise never fails
the gate, however large its point estimate. Latencies are compared on a log scale (the interval of the ratio of
geometric means, shown as the change it means from the baseline's mean): their noise is multiplicative, and on the
values themselves one slow repeat (CI: a repeat whose median TTFT was 3x the others' on a loaded machine) widens
the interval past zero even for an 8x regression. With one repeat on either side only (1) applies (and a warning says
so). Thresholds: `metric=5%` (relative to the baseline's mean) or `metric=0.01` (absolute, in the metric's unit);
the sign is ignored, the direction is the metric's own (higher TTFT is worse, lower goodput is worse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.eval.metrics import METRICS
from kvmesh.eval.stats import difference_interval, ratio_interval

DEFAULT_THRESHOLDS = "ttft_p95=5%,itl_p95=5%,goodput=-3%,cost_per_1k_output=+2%,golden=0,checks=0"
EXIT_OK, EXIT_REGRESSED, EXIT_BAD_INPUT = 0, 1, 2


class CompareError(ValueError):
    """The two results cannot be compared (another workload, a malformed file): exit 2."""


@dataclass(frozen=True)
class Threshold:
    metric: str
    amount: float  # >= 0
    is_relative: bool

    def allowed(self, baseline: float) -> float:
        return self.amount * abs(baseline) if self.is_relative else self.amount

    def __str__(self) -> str:
        return f"{self.amount * 100:g}%" if self.is_relative else f"{self.amount:g}"


def parse_thresholds(text: str) -> list[Threshold]:
    thresholds = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        metric, sep, value = item.partition("=")
        if not sep or metric not in METRICS:
            raise CompareError(f"--max-regression: {item!r} is not METRIC=AMOUNT with a known metric")
        is_relative = value.endswith("%")
        try:
            amount = abs(float(value.rstrip("%")))
        except ValueError:
            raise CompareError(f"--max-regression: {metric}'s amount {value!r} is not a number") from None
        thresholds.append(Threshold(metric, amount / 100 if is_relative else amount, is_relative))
    return thresholds


@dataclass(frozen=True)
class Verdict:
    metric: str
    baseline: float
    result: float
    change: float  # result - baseline
    low: float  # Welch's 95% interval of the change
    high: float
    threshold: Threshold
    is_regressed: bool


def check_same_workload(baseline: dict[str, Any], result: dict[str, Any]) -> None:
    """Raises CompareError unless both ran the same files with the same options (the workload's identity)."""
    if baseline["identity"] != result["identity"]:
        raise CompareError(
            f"the baseline was measured on another workload ({', '.join(baseline['sources'])}, options "
            f"{baseline['options']}) than the result ({', '.join(result['sources'])}, options {result['options']})"
        )


def check_comparable(baseline: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """Warnings about unlike setups; raises CompareError for another workload or a file that is no result."""
    for name, data in (("baseline", baseline), ("result", result)):
        if not isinstance(data, dict) or "summary" not in data or "workload" not in data:
            raise CompareError(f"the {name} is not a `kvmesh eval run` result")
    check_same_workload(baseline["workload"], result["workload"])
    warnings = []
    for part, keys in (("mesh", ("models", "workers", "labels", "client_version")), ("run", ("concurrency", "slo_s"))):
        for key in keys:
            before, after = baseline.get(part, {}).get(key), result.get(part, {}).get(key)
            if before != after:
                warnings.append(f"unlike setups: {part} {key} was {before!r} in the baseline, {after!r} now")
    if min(baseline["run"]["repeats"], result["run"]["repeats"]) < 2:
        warnings.append("one repeat on a side: no confidence interval, the threshold alone decides (use --repeats)")
    return warnings


def compare(baseline: dict[str, Any], result: dict[str, Any], thresholds: list[Threshold]) -> list[Verdict]:
    verdicts = []
    for threshold in thresholds:
        before = baseline["summary"].get(threshold.metric)
        after = result["summary"].get(threshold.metric)
        if before is None or after is None:
            continue  # not measured on this workload (no golden answers, no prices)
        change, low, high = difference_interval(before["values"], after["values"])
        if METRICS[threshold.metric].is_multiplicative and min(*before["values"], *after["values"]) > 0:
            _, ratio_low, ratio_high = ratio_interval(before["values"], after["values"])
            low, high = before["mean"] * (ratio_low - 1), before["mean"] * (ratio_high - 1)
        sign = 1 if not METRICS[threshold.metric].is_higher_better else -1  # worse is +
        worse, worse_low = sign * change, min(sign * low, sign * high)
        is_regressed = worse > threshold.allowed(before["mean"]) and worse_low > 0
        verdicts.append(
            Verdict(threshold.metric, before["mean"], after["mean"], change, low, high, threshold, is_regressed)
        )
    return verdicts


def table(verdicts: list[Verdict]) -> str:
    """One line per gated metric: the means, the change and its interval, the threshold, the verdict."""
    header = ("metric", "baseline", "result", "change", "95% interval", "allowed", "verdict")
    rows = [header]
    for v in verdicts:
        unit = METRICS[v.metric].unit
        relative = f" ({v.change / v.baseline * 100:+.1f}%)" if v.baseline else ""
        rows.append(
            (
                v.metric,
                f"{v.baseline:.4g} {unit}",
                f"{v.result:.4g} {unit}",
                f"{v.change:+.4g}{relative}",
                f"[{v.low:+.4g}, {v.high:+.4g}]",
                str(v.threshold),
                "REGRESSED" if v.is_regressed else "ok",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def exit_code(verdicts: list[Verdict]) -> int:
    return EXIT_REGRESSED if any(v.is_regressed for v in verdicts) else EXIT_OK
