"""Student's t over repeats: a metric's interval, and Welch's interval for the change between two runs.

Repeats are few (3 by default), so the intervals are t-intervals, not bootstrap ones: a bootstrap of three
values can only return those values. The t distribution's quantile is found by bisection on its CDF, integrated
with Simpson's rule (no SciPy in the project), to four decimals of the tables.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence

CONFIDENCE = 0.95


def _t_pdf(x: float, df: float) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf_above_zero(x: float, df: float, steps: int = 2000) -> float:
    """P(0 <= T <= x) by Simpson's rule (`steps` even)."""
    h = x / steps
    total = _t_pdf(0, df) + _t_pdf(x, df)
    total += sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, steps))
    return total * h / 3


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The p-quantile (p > 0.5) of Student's t with `df` degrees of freedom (not necessarily whole)."""
    assert 0.5 < p < 1 and df > 0
    low, high = 0.0, 1.0
    while 0.5 + _t_cdf_above_zero(high, df) < p:
        low, high = high, high * 2
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if 0.5 + _t_cdf_above_zero(middle, df) < p else (low, middle)
    return (low + high) / 2


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the t-interval of the mean; one value is its own interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = t_quantile(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def difference_interval(
    before: Sequence[float], after: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """(mean(after) - mean(before), low, high): Welch's interval (unequal variances, Welch-Satterthwaite df).
    With fewer than two values on a side, or no spread on either, the interval is the point itself."""
    difference = statistics.fmean(after) - statistics.fmean(before)
    if len(before) < 2 or len(after) < 2:
        return difference, difference, difference
    v_before = statistics.variance(before) / len(before)
    v_after = statistics.variance(after) / len(after)
    if v_before + v_after == 0:
        return difference, difference, difference
    df = (v_before + v_after) ** 2 / (v_before**2 / (len(before) - 1) + v_after**2 / (len(after) - 1))
    half = t_quantile(0.5 + confidence / 2, df) * math.sqrt(v_before + v_after)
    return difference, difference - half, difference + half


def ratio_interval(
    before: Sequence[float], after: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """(ratio, low, high) of after's geometric mean to before's: Welch's interval of the difference of the logs,
    taken back. For positive metrics whose noise is multiplicative (a latency on a busy machine: one slow repeat
    is 3x, not +300 ms), where Welch's interval on the values themselves is as wide as the slowest repeat."""
    if min(*before, *after) <= 0:
        raise ValueError("a ratio interval needs positive values")
    change, low, high = difference_interval([math.log(v) for v in before], [math.log(v) for v in after], confidence)
    return math.exp(change), math.exp(low), math.exp(high)
