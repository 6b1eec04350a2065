"""A rollout's gates: per-request samples by the version that served them, and the verdict on one step.

A step is judged only once both versions have served `min_samples` requests, at least one (no traffic is never a
failure: the step holds). Then the canary fails if its p95 time to first token or p95 inter-token latency exceeds
the stable version's times the gate's ratio, if its error rate exceeds the stable one's by more than the gate
allows, or if its cost per output token (tokens computed, prompt's uncached part and output, per output token: what
a worker pays for a useful token, whatever the price list) exceeds the stable one's times the ratio. A gate left at
0 is off.

The quality gate needs no samples: the golden prompts' greedy answers (the balancer's quality probe) are compared
token for token (`compare_answers`), and any difference rolls the canary back at once, whatever the step's traffic
(`with_quality`). Until the probe has matched in a step, the step does not advance; a probe that could not run
(no canary worker yet, a worker unreachable) holds it, as too few samples do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mesh.pb import events_pb2

HOLD, STEP, PROMOTE, ROLLBACK = "hold", "step", "promote", "rollback"


@dataclass(frozen=True)
class ServedSample:
    """One request's outcome, from its usage record (events.proto UsageRecord)."""

    at_s: float  # when it ended
    is_error: bool  # the client got a 5xx (or nothing)
    ttft_s: float | None  # None: no token came
    itl_s: float | None  # mean seconds between its output tokens; None under two tokens
    num_computed_tokens: int  # uncached prompt tokens + output tokens
    num_output_tokens: int

    @classmethod
    def from_usage(cls, record: events_pb2.UsageRecord) -> ServedSample:
        ttft_s = record.ttft_ms / 1000 if record.HasField("ttft_ms") else None
        itl_s = None
        if ttft_s is not None and record.completion_tokens >= 2:
            itl_s = max(record.e2e_ms / 1000 - ttft_s, 0.0) / (record.completion_tokens - 1)
        return cls(
            at_s=record.ended_at_ms / 1000,
            is_error=record.http_status >= 500 or record.http_status == 0,
            ttft_s=ttft_s,
            itl_s=itl_s,
            num_computed_tokens=max(record.prompt_tokens - record.cached_tokens, 0) + record.completion_tokens,
            num_output_tokens=record.completion_tokens,
        )


@dataclass(frozen=True)
class GateVerdict:
    action: str  # hold | step | promote | rollback
    reason: str


def p95(values: Sequence[float]) -> float:
    """The nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.95 * len(ordered)) - 1, 0)]


def judge(
    gates: events_pb2.RolloutGates, is_last_step: bool, stable: list[ServedSample], canary: list[ServedSample]
) -> GateVerdict:
    min_samples = max(gates.min_samples, 1)
    if len(canary) < min_samples or len(stable) < min_samples:
        return GateVerdict(HOLD, f"samples: canary {len(canary)}, stable {len(stable)} of {min_samples}")
    failed = _failed_gate(gates, stable, canary)
    if failed:
        return GateVerdict(ROLLBACK, failed)
    summary = f"gates passed on {len(canary)} canary and {len(stable)} stable requests"
    return GateVerdict(PROMOTE if is_last_step else STEP, summary)


def _failed_gate(gates: events_pb2.RolloutGates, stable: list[ServedSample], canary: list[ServedSample]) -> str:
    """What failed, in words; empty if nothing did."""
    for name, limit, of in (
        ("p95 TTFT", gates.max_ttft_p95_ratio, lambda s: s.ttft_s),
        ("p95 inter-token latency", gates.max_itl_p95_ratio, lambda s: s.itl_s),
    ):
        canary_values = [v for v in map(of, canary) if v is not None]
        stable_values = [v for v in map(of, stable) if v is not None]
        if limit > 0 and canary_values and stable_values:
            ratio = p95(canary_values) / max(p95(stable_values), 1e-6)
            if ratio > limit:
                return f"{name} {ratio:.2f}x stable's, over {limit:g}x"
    increase = _error_rate(canary) - _error_rate(stable)
    if gates.max_error_rate_increase > 0 and increase > gates.max_error_rate_increase:
        return f"error rate {increase:+.3f} against stable's, over +{gates.max_error_rate_increase:g}"
    ratio = _cost_per_token(canary) / max(_cost_per_token(stable), 1e-9)
    if gates.max_cost_per_token_ratio > 0 and ratio > gates.max_cost_per_token_ratio:
        return f"cost per output token {ratio:.2f}x stable's, over {gates.max_cost_per_token_ratio:g}x"
    return ""


def _error_rate(samples: list[ServedSample]) -> float:
    return sum(s.is_error for s in samples) / len(samples)


def _cost_per_token(samples: list[ServedSample]) -> float:
    return sum(s.num_computed_tokens for s in samples) / max(sum(s.num_output_tokens for s in samples), 1)


# -- the quality gate -----------------------------------------------------------------------------------------------
MATCH, MISMATCH, NOT_RUN = "match", "mismatch", "not_run"


@dataclass(frozen=True)
class ProbeOutcome:
    """What one run of the quality probe found."""

    result: str  # match | mismatch | not_run
    reason: str  # in words, for the decision log


def first_difference(stable: Sequence[int], canary: Sequence[int]) -> int | None:
    """The first position where two answers differ (where the shorter one ends, if it is a prefix); None if equal."""
    for position, (a, b) in enumerate(zip(stable, canary, strict=False)):
        if a != b:
            return position
    return None if len(stable) == len(canary) else min(len(stable), len(canary))


def compare_answers(
    prompts: Sequence[str], stable: Sequence[Sequence[int]], canary: Sequence[Sequence[int]]
) -> ProbeOutcome:
    """Each golden prompt's stable and canary answers, token for token; the first difference fails the gate."""
    assert len(prompts) == len(stable) == len(canary), "one answer per prompt and version"
    for index, (text, ours, theirs) in enumerate(zip(prompts, stable, canary, strict=True)):
        position = first_difference(ours, theirs)
        if position is not None:
            tokens = f"canary {_token_at(theirs, position)}, stable {_token_at(ours, position)}"
            return ProbeOutcome(
                MISMATCH, f"quality probe: prompt {index} ({text[:40]!r}) differs at token {position}: {tokens}"
            )
    return ProbeOutcome(MATCH, f"quality probe: {len(prompts)} answers identical")


def _token_at(answer: Sequence[int], position: int) -> str:
    return str(answer[position]) if position < len(answer) else "end"


def with_quality(verdict: GateVerdict, probe: ProbeOutcome) -> GateVerdict:
    """The step's verdict once the quality probe ran in it (a step whose probe already matched keeps its own)."""
    if verdict.action == ROLLBACK:
        return verdict
    if probe.result == MISMATCH:
        return GateVerdict(ROLLBACK, probe.reason)
    if probe.result == NOT_RUN:
        return GateVerdict(HOLD, f"{verdict.reason}; {probe.reason}" if verdict.action == HOLD else probe.reason)
    assert probe.result == MATCH, probe.result
    return replace(verdict, reason=f"{verdict.reason}; {probe.reason}")
