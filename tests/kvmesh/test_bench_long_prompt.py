"""`kvmesh bench long-prompt`: its two readings of TPOT and its count of block-id runs, on fixed inputs, and one
small arm on the tiny model: every figure is present, the control runs as many steps as the loaded phase, the long
prompt's blocks are counted, and streams too short to outlast the prompt fail the arm."""

from __future__ import annotations

import pytest

from engine_core.prefill_budget import MIN_CHUNK_TOKENS
from kvmesh.bench import long_prompt
from kvmesh.bench.long_prompt import count_runs, request_tpots, run_long_prompt_bench, stream_output_tokens


def test_request_tpot_is_each_streams_mean_gap() -> None:
    gaps = {"stream-0": [0.1, 0.1, 0.4], "stream-1": [0.2, 0.2]}
    assert [round(t, 9) for t in request_tpots(gaps)] == [0.2, 0.2]


def test_count_runs_counts_runs_of_consecutive_ids() -> None:
    assert count_runs([]) == 0
    assert count_runs([7]) == 1
    assert count_runs([3, 4, 5, 6]) == 1
    assert count_runs([3, 4, 9, 10, 11, 2, 12]) == 4  # [3, 4] [9, 10, 11] [2] [12]
    assert count_runs([5, 4]) == 2  # descending ids are not a run


def test_an_arm_reports_both_readings_and_the_block_runs() -> None:
    # 20 baseline steps (the bench's 64 would outrun deepseek-tiny's positions)
    report = run_long_prompt_bench("deepseek-tiny", 2, 100, [32], 2048, 0, (0.0,), baseline_steps=20)
    arm = report["results"]["threshold 32, step ratio 0"]
    (run,) = arm["rounds"]
    # the streams hold 6 blocks each (64 prompt tokens, 21 generated) and need no new one during the prompt's 4
    # chunks of 32 tokens: its 7 blocks are the next free ids, one run
    assert run["long_prompt_block_runs"] == 1
    assert run["long_prompt_steps"] == 4
    assert run["num_samples"] == [2 * 20, 2 * 4, 2 * 4]  # before, loaded, control: as many steps as loaded
    for reading in ("tpot", "request_tpot"):
        for ratio in (f"{reading}_p99_ratio", f"{reading}_p99_ratio_vs_before"):
            assert run[ratio] > 0
            assert arm[ratio] == run[ratio]  # one round: its median is itself
        for phase in ("before", "with_long_prompt", "control"):
            assert run[f"{reading}_{phase}_ms"]["p50"] <= run[f"{reading}_{phase}_ms"]["p99"]


def test_streams_outlast_the_slowest_prefill_the_budget_allows() -> None:
    # one token a step for the baseline, then at least the floor of the prompt a step, then a margin of 8
    assert stream_output_tokens(8000, 64) == 64 + -(-8000 // MIN_CHUNK_TOKENS) + 8
    assert stream_output_tokens(101, 20) == 20 + -(-101 // MIN_CHUNK_TOKENS) + 8


def test_an_arm_whose_streams_end_before_the_prompt_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # streams of 22 tokens: 20 baseline steps leave 2, and the prompt's 100 tokens at 32 a step take 4 steps
    monkeypatch.setattr(long_prompt, "stream_output_tokens", lambda prompt_tokens, baseline_steps: 22)
    with pytest.raises(RuntimeError, match=r"ended before the long prompt's first token"):
        run_long_prompt_bench("deepseek-tiny", 2, 100, [32], 2048, 0, (0.0,), baseline_steps=20)
