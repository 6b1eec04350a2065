"""A rollout step's verdict (mesh.rollout_gates) with exact samples: hold without enough of them, step or promote
when every gate passes, roll back naming the gate that failed."""

from __future__ import annotations

import pytest

from mesh.pb import events_pb2
from mesh.rollout_gates import (
    MATCH,
    MISMATCH,
    NOT_RUN,
    GateVerdict,
    ProbeOutcome,
    ServedSample,
    compare_answers,
    first_difference,
    judge,
    p95,
    with_quality,
)

GATES = events_pb2.RolloutGates(
    max_ttft_p95_ratio=1.5,
    max_itl_p95_ratio=1.5,
    max_error_rate_increase=0.05,
    max_cost_per_token_ratio=1.2,
    min_samples=10,
)


def sample(ttft_s: float = 0.1, itl_s: float = 0.02, is_error: bool = False, computed: int = 20) -> ServedSample:
    return ServedSample(
        at_s=0.0, is_error=is_error, ttft_s=ttft_s, itl_s=itl_s, num_computed_tokens=computed, num_output_tokens=10
    )


STABLE = [sample(ttft_s=0.1 + i / 1000) for i in range(20)]


def test_a_sample_reads_its_usage_record():
    record = events_pb2.UsageRecord(
        http_status=200,
        ttft_ms=100.0,
        e2e_ms=1000.0,
        prompt_tokens=50,
        cached_tokens=32,
        completion_tokens=10,
        ended_at_ms=5000,
    )
    assert ServedSample.from_usage(record) == ServedSample(5.0, False, 0.1, 0.1, 28, 10)
    failed = events_pb2.UsageRecord(http_status=503, e2e_ms=10.0, ended_at_ms=6000)
    assert ServedSample.from_usage(failed) == ServedSample(6.0, True, None, None, 0, 0)


def test_p95_is_the_nearest_rank():
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([3.0, 1.0, 2.0]) == 3.0


def test_too_few_samples_hold_the_step_never_fail_it():
    assert judge(GATES, False, STABLE, [sample(ttft_s=9.0)] * 9) == GateVerdict(
        "hold", "samples: canary 9, stable 20 of 10"
    )
    assert judge(GATES, False, [], []) == GateVerdict("hold", "samples: canary 0, stable 0 of 10")
    no_minimum = events_pb2.RolloutGates(max_ttft_p95_ratio=1.5)
    assert judge(no_minimum, False, STABLE, []) == GateVerdict("hold", "samples: canary 0, stable 20 of 1")


def test_passing_gates_step_and_the_last_step_promotes():
    canary = [sample(ttft_s=0.12) for _ in range(10)]
    assert judge(GATES, False, STABLE, canary) == GateVerdict(
        "step", "gates passed on 10 canary and 20 stable requests"
    )
    assert judge(GATES, True, STABLE, canary).action == "promote"


@pytest.mark.parametrize(
    ("canary", "reason"),
    [
        ([sample(ttft_s=0.3)] * 10, "p95 TTFT 2.54x stable's, over 1.5x"),
        ([sample(itl_s=0.05)] * 10, "p95 inter-token latency 2.50x stable's, over 1.5x"),
        ([sample()] * 9 + [sample(is_error=True)], "error rate +0.100 against stable's, over +0.05"),
        ([sample(computed=30)] * 10, "cost per output token 1.50x stable's, over 1.2x"),
    ],
)
def test_each_failed_gate_rolls_back_naming_itself(canary: list[ServedSample], reason: str):
    assert judge(GATES, False, STABLE, canary) == GateVerdict("rollback", reason)


def test_a_gate_at_0_is_off():
    gates = events_pb2.RolloutGates(min_samples=1)
    assert judge(gates, False, STABLE, [sample(ttft_s=50.0, is_error=True, computed=500)]).action == "step"


def test_answers_are_compared_token_for_token():
    prompts = ["a", "Name the three primary colors."]
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # the canary stopped early: it differs where it ended
    assert compare_answers(prompts, [[1], [1, 2, 3]], [[1], [1, 2, 3]]) == ProbeOutcome(
        MATCH, "quality probe: 2 answers identical"
    )
    assert compare_answers(prompts, [[1], [1, 2, 3]], [[1], [1, 2]]) == ProbeOutcome(
        MISMATCH, "quality probe: prompt 1 ('Name the three primary colors.') differs at token 2: canary end, stable 3"
    )
    assert compare_answers(prompts, [[7], [1, 2]], [[9], [1, 5]]).reason == (
        "quality probe: prompt 0 ('a') differs at token 0: canary 9, stable 7"
    )


def test_the_quality_gate_rolls_back_at_once_and_holds_a_step_until_its_probe_matched():
    held = GateVerdict("hold", "samples: canary 0, stable 0 of 10")
    passed = GateVerdict("step", "gates passed on 10 canary and 10 stable requests")
    matched = ProbeOutcome(MATCH, "quality probe: 4 answers identical")
    differs = ProbeOutcome(MISMATCH, "quality probe: prompt 0 ('a') differs at token 3: canary 9, stable 7")
    not_run = ProbeOutcome(NOT_RUN, "quality probe not run: the canary version has no worker for the model")
    assert with_quality(held, differs) == GateVerdict("rollback", differs.reason)  # no samples needed
    assert with_quality(passed, differs) == GateVerdict("rollback", differs.reason)
    assert with_quality(passed, matched) == GateVerdict("step", f"{passed.reason}; {matched.reason}")
    assert with_quality(held, matched) == GateVerdict("hold", f"{held.reason}; {matched.reason}")
    assert with_quality(passed, not_run) == GateVerdict("hold", not_run.reason)
    assert with_quality(held, not_run) == GateVerdict("hold", f"{held.reason}; {not_run.reason}")
    latency = GateVerdict("rollback", "p95 TTFT 4.00x stable's, over 1.5x")
    assert with_quality(latency, matched) == latency
