"""Latency-based outlier ejection (mesh.latency_outliers): a decode worker whose median inter-token latency is over
factor x its pool's others' is ejected for a while, never the pool's last one, and judged again on fresh samples."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.latency_outliers import Ejection, LatencyOutlierDetector, LatencyRule

RULE = LatencyRule(factor=3.0, window_s=5.0, min_samples=4, ejection_s=10.0, min_itl_s=0.005)
POOL = "deepseek-tiny"


def detector(live: set[str], rule: LatencyRule = RULE) -> LatencyOutlierDetector:
    return LatencyOutlierDetector(rule, lambda pool: sorted(live) if pool == POOL else [])


def feed(
    outliers: LatencyOutlierDetector, worker_id: str, itls: list[float], start_s: float, pool: str = POOL
) -> list[Ejection | None]:
    """One sample every 0.25 s from `start_s` (times exact in binary)."""
    return [outliers.record(pool, worker_id, itl, start_s + 0.25 * i) for i, itl in enumerate(itls)]


def test_a_worker_four_times_slower_than_the_other_is_ejected_on_its_fourth_sample() -> None:
    outliers = detector({"d0", "d1"})
    assert feed(outliers, "d1", [0.1, 0.1, 0.2, 0.1], 0.0) == [None] * 4  # d1's median: 0.1; no reference yet
    assert feed(outliers, "d0", [0.5, 0.4, 0.6], 1.0) == [None] * 3  # fewer than min_samples: not judged
    ejection = outliers.record(POOL, "d0", 0.5, 1.75)
    assert ejection == Ejection(POOL, "d0", itl_s=0.5, reference_s=0.1, until_s=11.75, num_in_a_row=1)
    assert (outliers.ejected_ids(POOL, 1.75), outliers.num_ejections) == (["d0"], 1)
    assert outliers.itl_s(POOL, "d0", 1.75) is None  # its samples went with the ejection
    assert outliers.reference_s(POOL, "d1", 1.75) is None  # and an ejected worker is no one's reference
    assert feed(outliers, "d1", [0.1] * 8, 2.0) == [None] * 8  # the one left in is never ejected


def test_within_factor_or_under_the_floor_is_not_slow() -> None:
    outliers = detector({"d0", "d1"})
    feed(outliers, "d1", [0.1] * 4, 0.0)
    assert feed(outliers, "d0", [0.3] * 6, 1.0) == [None] * 6  # 3x exactly: not over
    floor = detector({"d0", "d1"})
    feed(floor, "d1", [0.001] * 4, 0.0)
    assert feed(floor, "d0", [0.004] * 6, 1.0) == [None] * 6  # 4x, but under min_itl_s: the gateway's jitter
    assert floor.ejected_ids(POOL, 3.0) == []


def test_a_lone_worker_or_one_compared_with_a_dead_one_is_never_ejected() -> None:
    alone = detector({"d0"})
    assert feed(alone, "d0", [9.0] * 8, 0.0) == [None] * 8
    live = {"d0", "d1"}
    outliers = detector(live)
    feed(outliers, "d1", [0.1] * 4, 0.0)
    live.discard("d1")  # d1 failed its checks: its samples are no reference
    assert feed(outliers, "d0", [1.0] * 6, 1.0) == [None] * 6
    live.add("d1")
    assert outliers.record(POOL, "d0", 1.0, 2.5) == Ejection(POOL, "d0", 1.0, 0.1, 12.5, 1)


def test_samples_older_than_the_window_are_forgotten() -> None:
    outliers = detector({"d0", "d1"})
    feed(outliers, "d1", [0.1] * 4, 0.0)  # at 0.0-0.75 s
    assert outliers.reference_s(POOL, "d0", 5.0) == 0.1
    assert outliers.reference_s(POOL, "d0", 5.01) is None  # the first fell out of the 5 s window: 3 left
    assert feed(outliers, "d0", [1.0] * 4, 6.0) == [None] * 4


def test_ejected_again_in_a_row_stays_out_longer_and_a_healthy_judgement_starts_over() -> None:
    live = {"d0", "d1"}
    outliers = detector(live, LatencyRule(factor=3.0, window_s=100.0, min_samples=2, ejection_s=10.0))
    feed(outliers, "d1", [0.1] * 2, 0.0)
    assert feed(outliers, "d0", [1.0] * 2, 1.0)[-1] == Ejection(POOL, "d0", 1.0, 0.1, 11.25, 1)
    assert outliers.record(POOL, "d0", 1.0, 5.0) is None  # not taken while out
    assert (outliers.is_ejected(POOL, "d0", 11.0), outliers.is_ejected(POOL, "d0", 11.25)) == (True, False)
    assert feed(outliers, "d0", [1.0] * 2, 12.0)[-1] == Ejection(POOL, "d0", 1.0, 0.1, 32.25, 2)  # twice as long
    assert feed(outliers, "d0", [0.1] * 2, 33.0) == [None, None]  # back, and judged healthy: the count starts over
    # the healthy samples are still in the window: out again once slow ones outweigh them, for 10 s again
    assert feed(outliers, "d0", [1.0] * 2, 34.0) == [None, Ejection(POOL, "d0", 0.55, 0.1, 44.25, 1)]


def test_pools_are_judged_apart_and_a_departed_worker_is_forgotten() -> None:
    outliers = detector({"d0", "d1"})
    feed(outliers, "d1", [0.1] * 4, 0.0)
    feed(outliers, "d1", [0.1] * 4, 0.0, pool="smollm2-135m")  # no live workers listed for this pool
    assert feed(outliers, "d0", [1.0] * 4, 1.0, pool="smollm2-135m") == [None] * 4
    assert feed(outliers, "d0", [1.0] * 4, 1.0)[-1] is not None
    outliers.forget("d0")
    assert (outliers.ejected_ids(POOL, 2.0), outliers.itl_s("smollm2-135m", "d0", 2.0)) == ([], None)


def test_a_worker_is_judged_at_most_every_50_ms() -> None:
    outliers = detector({"d0", "d1"})
    feed(outliers, "d1", [0.1] * 4, 0.0)
    times = [1.0, 1.01, 1.02, 1.03, 1.04, 1.06]  # the fourth sample comes between two judgements
    assert [outliers.record(POOL, "d0", 1.0, t) for t in times][3:] == [
        None,
        None,
        Ejection(POOL, "d0", 1.0, 0.1, 11.06, 1),
    ]


def test_off_records_nothing() -> None:
    outliers = detector({"d0", "d1"}, LatencyRule(factor=0))
    feed(outliers, "d1", [0.1] * 8, 0.0)
    assert feed(outliers, "d0", [9.0] * 8, 2.0) == [None] * 8
    assert outliers.itl_s(POOL, "d1", 2.0) is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("factor", 1.0, "factor=1.0: must be over 1 (0: never eject for latency)"),
        ("window_s", 0.0, "window_s=0.0: must be positive"),
        ("ejection_s", -1.0, "ejection_s=-1.0: must be positive"),
        ("min_samples", 0, "min_samples=0: must be at least 1"),
        ("min_itl_s", -0.1, "min_itl_s=-0.1: must not be negative"),
    ],
)
def test_a_bad_rule_is_refused_naming_its_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        LatencyRule(**{field: value})
    assert str(raised.value) == message
