"""`kvmesh bench long-prompt`: what a long prompt arriving does to the streams already decoding.

For each arm, a `long_prefill_token_threshold` (0: no cap) and a `long_prefill_step_ratio` (0: off), a fresh engine
starts `streams` requests (short prompts, outputs long enough to outlast the prompt's prefill) and, once all of them
decode, steps `baseline_steps` times: each stream's gaps between two tokens then are the "before" samples. Then one
long prompt arrives (max_tokens 1: it leaves once prefilled, so what is measured is its prefill, not the longer
decode attention it would add afterwards) and the engine steps until it is done; the streams' gaps meanwhile are
the samples under load. A second engine, alike and with the same streams, is the control: it steps in turn with
the loaded one, a step each, with no long prompt, so its gaps are the streams' at the same contexts (a stream's
step grows with its context: over an 8k prompt's thousands of steps they grow by as many tokens) and at the same
moments (a shared host drifts over minutes: run after the loaded phase, the control's decode-only steps cost
10-25% more than the loaded engine's own at the same step, on a 2-core Xeon, 2026-12-07). Each engine keeps its
own clock, the time spent in its own steps, so a gap is what a stream of an engine alone on the machine would
wait, and the other engine's turns count in neither. The goal's ratio is the loaded phase's TPOT p99 over the
control's (`tpot_p99_ratio`: what the prompt adds); the ratio over the "before" phase is reported beside it
(`tpot_p99_ratio_vs_before`: the streams' own growth counted against the prompt, the harsher reading). A stream that
ends before the long prompt's first token would leave the rest of the prefill unmeasured: the arm fails instead.
Two readings of TPOT: per gap (every gap between two tokens of any stream is a sample: the skeptical one, since a
single slow step shows in its p99) and per request (vLLM's definition, (e2e - TTFT) / (tokens - 1): each stream's
mean gap over the phase is one sample, so the p99 is about the slowest stream's mean). Also how many runs of
consecutive block ids the long prompt's KV blocks formed (a run can be read in place, without a gather).
With several rounds the arms alternate round by round, so that load elsewhere on the machine hits each alike, and
each figure's median over the rounds is reported beside the rounds' own.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine_core import LLM, LLMEngine, SamplingParams
from engine_core.prefill_budget import MIN_CHUNK_TOKENS

BLOCK_SIZE = 16
STREAM_PROMPT_TOKENS = 64
BASELINE_STEPS = 64  # decode-only steps measured first: 512 gaps with 8 streams (160 made a fragile p99)
GOAL_RATIO = 2.0


def run_long_prompt_bench(
    model: str,
    streams: int,
    prompt_tokens: int,
    thresholds: list[int],
    max_num_batched_tokens: int,
    seed: int,
    step_ratios: Sequence[float] = (0.0,),
    rounds: int = 1,
    baseline_steps: int = BASELINE_STEPS,
) -> dict[str, Any]:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    arms = [(t, r) for t in thresholds for r in step_ratios]
    runs: dict[str, list[dict[str, Any]]] = {_arm_name(t, r): [] for t, r in arms}
    for _ in range(rounds):
        for threshold, ratio in arms:
            runs[_arm_name(threshold, ratio)].append(
                _one_arm(model, streams, prompt_tokens, threshold, ratio, max_num_batched_tokens, seed, baseline_steps)
            )
    results = {name: _medians(arm_runs) for name, arm_runs in runs.items()}
    return {
        "model": model,
        "torch_threads": torch.get_num_threads(),
        "streams": streams,
        "long_prompt_tokens": prompt_tokens,
        "max_num_batched_tokens": max_num_batched_tokens,
        "rounds": rounds,
        "results": results,
        "goal": f"tpot_p99_ratio <= {GOAL_RATIO}",
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _arm_name(threshold: int, ratio: float) -> str:
    return f"threshold {threshold}, step ratio {ratio:g}"


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm's rounds: the median of each figure, and the rounds themselves."""
    figures = (
        "tpot_p99_ratio",
        "request_tpot_p99_ratio",
        "tpot_p99_ratio_vs_before",
        "request_tpot_p99_ratio_vs_before",
        "long_prompt_ttft_s",
    )
    summary: dict[str, Any] = {f: round(statistics.median(run[f] for run in runs), 3) for f in figures}
    for reading in ("tpot", "request_tpot"):
        for phase in (f"{reading}_before_ms", f"{reading}_with_long_prompt_ms", f"{reading}_control_ms"):
            summary[phase] = {p: round(statistics.median(run[phase][p] for run in runs), 2) for p in ("p50", "p99")}
    summary["rounds"] = runs
    return summary


def stream_output_tokens(prompt_tokens: int, baseline_steps: int) -> int:
    """Tokens each stream generates: the baseline steps, then one a step for as many steps as the long prompt's
    prefill can take (each step computes at least the budget's floor of it while streams decode), and a margin."""
    return baseline_steps + -(-prompt_tokens // MIN_CHUNK_TOKENS) + 8


def _one_arm(
    model: str,
    streams: int,
    prompt_tokens: int,
    threshold: int,
    ratio: float,
    max_num_batched_tokens: int,
    seed: int,
    baseline_steps: int = BASELINE_STEPS,
) -> dict[str, Any]:
    """One arm: the loaded engine and its control (the same streams, no long prompt), a step each in turn."""
    output_tokens = stream_output_tokens(prompt_tokens, baseline_steps)
    stream_ids = [f"stream-{i}" for i in range(streams)]

    def start() -> tuple[LLMEngine, random.Random, _Clock, dict[str, list[float]]]:
        """A fresh engine whose streams have decoded `baseline_steps` steps; their gaps meanwhile."""
        context = prompt_tokens + BLOCK_SIZE
        llm = LLM(
            model,
            enable_prefix_caching=False,
            block_size=BLOCK_SIZE,
            num_kv_blocks=streams * -(-(STREAM_PROMPT_TOKENS + output_tokens) // BLOCK_SIZE)
            + -(-context // BLOCK_SIZE),
            max_model_len=max(context, STREAM_PROMPT_TOKENS + output_tokens),
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=threshold,
            long_prefill_step_ratio=ratio,
        )
        engine = llm.engine
        rng = random.Random(seed)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
        for request_id in stream_ids:
            engine.add_request(request_id, [rng.randrange(vocab) for _ in range(STREAM_PROMPT_TOKENS)], params)
        clock = _Clock()
        while len(clock.last_token_at) < streams:  # prefill the streams; the clock starts at each one's first token
            _step(engine, clock, {})
        before: dict[str, list[float]] = {}
        for _ in range(baseline_steps):
            _step(engine, clock, before)
        return engine, rng, clock, before

    engine, rng, clock, before = start()
    control_engine, _, control_clock, _ = start()
    loaded: dict[str, list[float]] = {}
    control: dict[str, list[float]] = {}
    long_block_ids: list[int] = []
    arrived = clock.now
    vocab = engine.model_config.vocab_size
    engine.add_request("long", [rng.randrange(vocab) for _ in range(prompt_tokens)], SamplingParams(max_tokens=1))
    num_loaded_steps = 0
    while "long" not in clock.last_token_at:
        long_block_ids = engine.kv.block_ids("long") or long_block_ids  # freed in the step that finishes it
        _step(engine, clock, loaded)
        _step(control_engine, control_clock, control)
        num_loaded_steps += 1
    ttft = clock.last_token_at["long"] - arrived
    short = [r for r in stream_ids if len(loaded.get(r, ())) != num_loaded_steps]
    if short:
        raise RuntimeError(f"streams {short} ended before the long prompt's first token: the load was not measured")
    phases = {"before": before, "with_long_prompt": loaded, "control": control}
    report: dict[str, Any] = {}
    for name, gaps in phases.items():
        report[f"tpot_{name}_ms"] = _percentiles(_flat(gaps))
        report[f"request_tpot_{name}_ms"] = _percentiles(request_tpots(gaps))
    for reading, samples in (("tpot", _flat), ("request_tpot", request_tpots)):
        loaded_p99 = _p99(samples(loaded))
        report[f"{reading}_p99_ratio"] = round(loaded_p99 / _p99(samples(control)), 3)
        report[f"{reading}_p99_ratio_vs_before"] = round(loaded_p99 / _p99(samples(before)), 3)
    return {
        **report,
        "long_prompt_ttft_s": round(ttft, 3),
        "long_prompt_steps": num_loaded_steps,
        "long_prompt_block_runs": count_runs(long_block_ids),
        "num_samples": [len(_flat(phase)) for phase in phases.values()],
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


class _Clock:
    """One engine's time: the seconds spent in its own steps (`now`), and when each request last got a token."""

    def __init__(self) -> None:
        self.now = 0.0
        self.last_token_at: dict[str, float] = {}


def _step(engine: LLMEngine, clock: _Clock, gaps: dict[str, list[float]]) -> None:
    """One engine step on its clock; each stream's time since its previous token goes to `gaps[stream id]`."""
    started = time.perf_counter()
    outputs = engine.step()
    clock.now += time.perf_counter() - started
    for output in outputs:
        if not output.new_token_ids:
            continue
        previous = clock.last_token_at.get(output.request_id)
        if previous is not None and output.request_id != "long":
            gaps.setdefault(output.request_id, []).append(clock.now - previous)
        clock.last_token_at[output.request_id] = clock.now


def _flat(gaps: dict[str, list[float]]) -> list[float]:
    return [gap for stream_gaps in gaps.values() for gap in stream_gaps]


def request_tpots(gaps: dict[str, list[float]]) -> list[float]:
    """Each stream's TPOT over the phase as vLLM defines it: (e2e - TTFT) / (tokens - 1), its mean gap."""
    return [statistics.fmean(stream_gaps) for stream_gaps in gaps.values()]


def count_runs(block_ids: Sequence[int]) -> int:
    """How many runs of consecutive ids (each one more than the last) `block_ids` forms."""
    return sum(1 for i, block_id in enumerate(block_ids) if i == 0 or block_id != block_ids[i - 1] + 1)


def _p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def _percentiles(samples: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(samples) * 1e3, 2), "p99": round(_p99(samples) * 1e3, 2)}
