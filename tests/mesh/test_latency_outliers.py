"""Latency-based outlier ejection (mesh.latency_outliers): a decode worker whose time per token is over factor x
its pool's others' is ejected for a while, never the pool's last one, and judged again on fresh samples."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.latency_outliers import Ejection, LatencyOutlierDetector, LatencyRule

RULE = LatencyRule(factor=3.0, window_s=5.0, min_samples=4, ejection_s=10.0, min_itl_s=0.005)
POOL = "deepseek-tiny"


def detector(live: set[str], rule: LatencyRule = RULE) -> LatencyOutlierDetector:
    return LatencyOutlierDetector(rule, lambda pool: sorted(live) if pool == POOL else [])


def feed(
    outliers: LatencyOutlierDetector, worker_id: str, itls: list[float], start_s: float, step_s: float = 1.0
) -> list[Ejection | None]:
    """One sample every `step_s` from `start_s` (times exact in binary)."""
    return [outliers.record(POOL, worker_id, itl, start_s + step_s * i) for i, itl in enumerate(itls)]


def rounds(
    outliers: LatencyOutlierDetector, fast_itls: list[float], slow_itls: list[float], start_s: float = 0.0
) -> list[Ejection | None]:
    """A round a second: a sample of d1 at its start, one of d0 half a second later; d0's outcomes."""
    outcomes = []
    for i, (fast, slow) in enumerate(zip(fast_itls, slow_itls, strict=True)):
        outliers.record(POOL, "d1", fast, start_s + i)
        outcomes.append(outliers.record(POOL, "d0", slow, start_s + i + 0.5))
    return outcomes


def test_a_worker_slower_than_the_other_throughout_the_window_is_ejected() -> None:
    outliers = detector({"d0", "d1"})
    # d0's 4th sample: enough, but all but one in the newer half of its window; the 5th: two in the older
    outcomes = rounds(outliers, [0.1, 0.1, 0.2, 0.1, 0.1], [0.5, 0.4, 0.6, 0.5, 0.5])
    assert outcomes[:4] == [None] * 4
    # d1's time per token: 0.6 s over 5 tokens
    assert outcomes[4] == Ejection(POOL, "d0", 0.5, reference_s=pytest.approx(0.12), until_s=14.5, num_in_a_row=1)
    assert (outliers.ejected_ids(POOL, 4.5), outliers.num_ejections) == (["d0"], 1)
    assert outliers.itl_s(POOL, "d0", 4.5) is None  # its samples went with the ejection
    assert outliers.reference_s(POOL, "d1", 4.5) is None  # and an ejected worker is no one's reference
    assert feed(outliers, "d1", [0.1] * 8, 5.0) == [None] * 8  # the one left in is never ejected


def test_a_burst_shorter_than_half_the_window_ejects_nobody() -> None:
    outliers = detector({"d0", "d1"})
    rounds(outliers, [0.1] * 6, [0.1] * 6)  # d0 at 0.5-5.5 s
    feed(outliers, "d1", [0.1, 0.1], 6.0)
    burst = feed(outliers, "d0", [1.0] * 6, 6.0, step_s=0.25)  # 6-7.25 s: most of the window's samples
    assert burst == [None] * 6
    # slow over the window (4 x 0.1 s and 6 x 1.0 s over 10 tokens), but not in its older half
    assert outliers.itl_s(POOL, "d0", 7.25) == pytest.approx(0.64)


def test_within_factor_or_under_the_floor_is_not_slow() -> None:
    outliers = detector({"d0", "d1"})
    assert rounds(outliers, [0.1] * 8, [0.3] * 8) == [None] * 8  # 3x exactly: not over
    floor = detector({"d0", "d1"})
    assert rounds(floor, [0.001] * 8, [0.004] * 8) == [None] * 8  # 4x, but under min_itl_s: the gateway's jitter
    assert floor.ejected_ids(POOL, 8.0) == []


def test_a_lone_worker_or_one_compared_with_a_dead_one_is_never_ejected() -> None:
    alone = detector({"d0"})
    assert feed(alone, "d0", [9.0] * 8, 0.0) == [None] * 8
    live = {"d0", "d1"}
    outliers = detector(live)
    live.discard("d1")  # d1 failed its checks: its samples are no reference
    assert rounds(outliers, [0.1] * 6, [1.0] * 6) == [None] * 6
    live.add("d1")
    assert outliers.record(POOL, "d0", 1.0, 6.0) == Ejection(POOL, "d0", 1.0, 0.1, 16.0, 1)


def test_samples_older_than_the_window_are_forgotten() -> None:
    outliers = detector({"d0", "d1"})
    feed(outliers, "d1", [0.1] * 4, 0.0, step_s=0.25)  # at 0.0-0.75 s
    assert outliers.reference_s(POOL, "d0", 5.0) == 0.1
    assert outliers.reference_s(POOL, "d0", 5.01) is None  # the first fell out of the 5 s window: 3 left


def test_ejected_again_in_a_row_stays_out_longer_and_a_healthy_judgement_starts_over() -> None:
    live = {"d0", "d1"}
    outliers = detector(live, LatencyRule(factor=3.0, window_s=4.0, min_samples=2, ejection_s=10.0))
    assert rounds(outliers, [0.1] * 4, [1.0] * 4)[-1] == Ejection(POOL, "d0", 1.0, 0.1, 13.5, 1)
    assert outliers.record(POOL, "d0", 1.0, 5.0) is None  # not taken while out
    assert (outliers.is_ejected(POOL, "d0", 13.0), outliers.is_ejected(POOL, "d0", 13.5)) == (True, False)
    assert rounds(outliers, [0.1] * 4, [1.0] * 4, 14.0)[-1] == Ejection(POOL, "d0", 1.0, 0.1, 37.5, 2)  # 2x as long
    # back, and judged healthy: the count starts over (the healthy samples delay the next ejection by a round)
    assert rounds(outliers, [0.1] * 3, [0.1] * 3, 38.0) == [None] * 3
    ejection = Ejection(POOL, "d0", pytest.approx(0.82), 0.1, 54.5, 1)  # one healthy sample left in the window
    assert rounds(outliers, [0.1] * 4, [1.0] * 4, 41.0)[-1] == ejection


def test_pools_are_judged_apart_and_a_departed_worker_is_forgotten() -> None:
    outliers = detector({"d0", "d1"})
    for i in range(6):  # the other pool lists no live worker: nobody to compare with
        outliers.record("smollm2-135m", "d1", 0.1, i)
        assert outliers.record("smollm2-135m", "d0", 1.0, i + 0.5) is None
    assert rounds(outliers, [0.1] * 5, [1.0] * 5)[-1] is not None
    outliers.forget("d0")
    assert (outliers.ejected_ids(POOL, 6.0), outliers.itl_s("smollm2-135m", "d0", 6.0)) == ([], None)


def test_a_worker_is_judged_at_most_every_50_ms() -> None:
    outliers = detector({"d0", "d1"})
    rounds(outliers, [0.1] * 4, [1.0] * 4)  # d0 at 0.5-3.5 s: one sample short of the older half's two
    times = [4.0, 4.01, 4.02, 4.03, 4.0625]  # 4.0: its older half still short; 4.01-4.03: not judged
    assert [outliers.record(POOL, "d0", 1.0, t) for t in times] == [None] * 4 + [
        Ejection(POOL, "d0", 1.0, 0.1, 14.0625, 1)
    ]


def test_a_throttled_worker_is_judged_on_its_time_per_token_not_the_median_gap() -> None:
    """Running 60 ms of every 300 ms: two quick gaps (20 ms a token while it runs) and a long one (the stop) in
    turn. The median gap is a quick one; its streams take 0.1 s a token, 5x the other worker's."""
    outliers = detector({"d0", "d1"})
    outcomes = []
    for i, gap_s in enumerate([0.02, 0.02, 0.26] * 8):  # a sample of d1 every 0.2 s, one of d0 0.1 s after it
        outliers.record(POOL, "d1", 0.02, 0.2 * i)
        outcomes.append(outliers.record(POOL, "d0", gap_s, 0.2 * i + 0.1))
    # judged slow once the window's older half (before now - 2.5 s) holds a whole cycle: at 3.1 s, on 16 samples
    # (5 cycles and a quick gap: 1.52 s over 16 tokens)
    ejection = Ejection(POOL, "d0", pytest.approx(0.095), pytest.approx(0.02), pytest.approx(13.1), 1)
    assert [(i, o) for i, o in enumerate(outcomes) if o is not None] == [(15, ejection)]


def test_tokens_weigh_a_sample() -> None:
    outliers = detector({"d0"})
    feed(outliers, "d0", [0.1, 0.1, 0.1], 0.0)
    outliers.record(POOL, "d0", 0.9, 3.0, num_tokens=9)  # 9 tokens in one batch, 0.1 s each
    assert outliers.itl_s(POOL, "d0", 3.0) == pytest.approx(0.1)


def test_off_records_nothing() -> None:
    outliers = detector({"d0", "d1"}, LatencyRule(factor=0))
    assert rounds(outliers, [0.1] * 8, [9.0] * 8) == [None] * 8
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
