"""Outlier ejection (mesh.outliers): consecutive failures eject, one success re-admits."""

from __future__ import annotations

import pytest

from mesh.outliers import OutlierDetector


def test_three_failures_in_a_row_eject_and_one_success_readmits() -> None:
    detector = OutlierDetector(eject_after=3)
    assert [detector.failure("d0") for _ in range(4)] == [False, False, True, False]  # ejected once, by the third
    assert (detector.is_ejected("d0"), detector.num_failures("d0"), detector.num_ejections) == (True, 4, 1)
    assert detector.success("d0") is True
    assert (detector.is_ejected("d0"), detector.num_failures("d0")) == (False, 0)
    assert detector.success("d0") is False  # already in


def test_a_success_in_between_starts_the_count_over() -> None:
    detector = OutlierDetector(eject_after=3)
    outcomes = [detector.failure("d0"), detector.failure("d0"), detector.success("d0"), detector.failure("d0")]
    assert outcomes == [False, False, False, False]
    assert (detector.is_ejected("d0"), detector.num_failures("d0"), detector.num_ejections) == (False, 1, 0)


def test_workers_are_counted_apart_and_forgotten_whole() -> None:
    detector = OutlierDetector(eject_after=2)
    detector.failure("d0")
    detector.failure("d1")
    assert detector.failure("d1") is True
    assert detector.ejected_ids == frozenset({"d1"}) and detector.num_failures("d0") == 1
    detector.forget("d1")
    assert detector.ejected_ids == frozenset() and detector.num_failures("d1") == 0


def test_ejecting_after_zero_failures_is_refused() -> None:
    with pytest.raises(ValueError, match="eject_after=0"):
        OutlierDetector(eject_after=0)
