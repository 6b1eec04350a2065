"""Fetch or recompute (services/prefill/fetch_decision.py): the fitted rates and the decision they give.

Rates are set by hand here, so every predicted time is exact: the store reads 1 MB blocks at 10 ms + 1 ms per
block, the engine computes at 5 ms + 0.1 ms per token, blocks hold 16 tokens.
"""

from __future__ import annotations

import pytest

from mesh.config import SettingError, load_settings
from services.prefill.config import PrefillSettings
from services.prefill.fetch_decision import FetchPlanner, FetchQuestion, RateFit


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def planner(mode: str = "auto", clock: Clock | None = None) -> FetchPlanner:
    chosen = FetchPlanner(
        mode,
        store=RateFit(fixed_s=0.010, per_unit_s=1e-9),
        compute=RateFit(fixed_s=0.005, per_unit_s=1e-4),
        monotonic=clock or Clock(),
    )
    chosen.observe_read(0, 0.0)  # a read just now (too small to fit): no probe due
    return chosen


def question(num_stored: int, is_streamed: bool = False, num_queued: int = 0) -> FetchQuestion:
    return FetchQuestion(
        num_stored_blocks=num_stored,
        block_tokens=16,
        block_bytes=10**6,
        num_layers=10,
        num_new_tokens=16 * num_stored + 1,
        num_queued_tokens=num_queued,
        is_streamed=is_streamed,
    )


def test_a_fit_separates_the_fixed_cost_from_the_rate():
    fit = RateFit(fixed_s=1.0, per_unit_s=1.0)
    for units, seconds in ((100, 0.3), (200, 0.5), (300, 0.7), (100, 0.3)):
        fit.observe(units, seconds)
    assert (fit.fixed_s, fit.per_unit_s) == (pytest.approx(0.1), pytest.approx(0.002))
    assert fit.predict(1000) == pytest.approx(2.1)
    assert fit.predict(0) == 0.0


def test_until_it_can_separate_them_a_fit_keeps_the_prior_fixed_cost():
    fit = RateFit(fixed_s=0.02, per_unit_s=1.0)
    fit.observe(100, 0.07)
    assert (fit.fixed_s, fit.per_unit_s) == (0.02, pytest.approx(5e-4))
    fit.observe(0, 5.0)  # nothing moved: not a sample
    assert fit.num_samples == 1
    quick = RateFit(fixed_s=0.02, per_unit_s=1.0)
    quick.observe(100, 0.01)  # quicker than the prior's fixed cost alone: half of it is fixed, half per unit
    assert (quick.fixed_s, quick.per_unit_s) == (pytest.approx(0.005), pytest.approx(5e-5))


def test_a_short_prefix_is_computed_and_a_long_one_read():
    short = planner().decide(question(2))  # read 12 ms + compute 5.1 ms, or compute 8.3 ms
    assert (short.choice, short.num_fetch_blocks) == ("recompute", 0)
    assert (short.predicted_s, short.predicted_fetch_s) == (pytest.approx(0.0083), pytest.approx(0.0171))
    long = planner().decide(question(100))  # read 110 ms + 5.1 ms, or compute 165.1 ms
    assert (long.choice, long.num_fetch_blocks) == ("fetch", 100)
    assert (long.predicted_s, long.predicted_recompute_s) == (pytest.approx(0.1151), pytest.approx(0.1651))
    assert long.attributes()["kvmesh.kv.fetch.choice"] == "fetch"
    assert long.attributes()["kvmesh.kv.fetch.store_bytes_per_s"] == 10**9


def test_a_streamed_read_fetches_the_head_while_the_engine_computes_the_tail():
    # the read of f blocks (10 + f ms) overlaps the compute of the rest (165.1 - 1.6 f ms): they cross near f = 57
    decision = planner().decide(question(100, is_streamed=True))
    assert (decision.choice, decision.num_fetch_blocks) == ("partial", 57)
    assert decision.predicted_s == pytest.approx(0.067 + 0.0739 / 10)


def test_a_queue_ahead_hides_a_streamed_read():
    # 500 queued tokens: 50 ms of queue, longer than reading both blocks (12 ms), so reading costs nothing
    decision = planner().decide(question(2, is_streamed=True, num_queued=500))
    assert (decision.choice, decision.num_fetch_blocks, decision.queue_s) == ("fetch", 2, pytest.approx(0.05))


def test_recompute_must_win_clearly_or_the_engine_is_spared():
    chosen = planner()
    chosen.margin = 0.6  # recomputing 2 blocks is 51% quicker than reading them: not enough
    assert chosen.decide(question(2)).num_fetch_blocks == 2


def test_a_store_not_read_for_a_while_is_read_once_to_measure_it():
    clock = Clock()
    chosen = planner(clock=clock)
    clock.now_s += 29
    assert chosen.decide(question(2)).choice == "recompute"
    clock.now_s += 2
    probe = chosen.decide(question(2))
    assert (probe.choice, probe.num_fetch_blocks) == ("probe", 2)


def test_a_forced_mode_overrides_the_prediction():
    assert planner("always").decide(question(2)).num_fetch_blocks == 2
    assert planner("never").decide(question(100)).num_fetch_blocks == 0
    assert planner("never").decide(question(100)).choice == "forced"


def test_an_unknown_fetch_mode_fails_naming_the_setting():
    with pytest.raises(SettingError, match="KVMESH_KV_FETCH='sometimes': must be one of auto, always, never"):
        load_settings(PrefillSettings, env={"KVMESH_KV_FETCH": "sometimes"})
    with pytest.raises(ValueError, match="fetch mode"):
        FetchPlanner("sometimes")
