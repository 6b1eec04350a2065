"""`kvmesh bench long-prompt`: its two readings of TPOT and its count of block-id runs, on fixed inputs, and one
small arm on the tiny model: every figure is present and the long prompt's blocks are counted."""

from __future__ import annotations

from kvmesh.bench.long_prompt import count_runs, request_tpots, run_long_prompt_bench


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
    assert run["num_samples"] == [2 * 20, 2 * 4]
    for reading in ("tpot", "request_tpot"):
        assert run[f"{reading}_p99_ratio"] > 0
        assert run[f"{reading}_baseline_ms"]["p50"] <= run[f"{reading}_baseline_ms"]["p99"]
