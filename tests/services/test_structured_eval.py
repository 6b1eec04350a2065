"""The evaluations' CI-sized samples (kvmesh.bench.structured; the full runs are bench/tools_bfcl.py and
bench/jsonschemabench.py): every BFCL tool call generated under the grammar parses and validates against its
schema, and every completed output for a supported jsonschemabench schema validates."""

from __future__ import annotations

from pathlib import Path

from kvmesh.bench.structured import bfcl_matches, bfcl_schema, run_bfcl, run_jsonschemabench

DATA = Path(__file__).resolve().parents[1] / "data"  # the samples: tests/data/README.md


def test_bfcl_sample_calls_parse_and_validate(smollm2_llm) -> None:
    report = run_bfcl(
        DATA / "bfcl", "smollm2-135m", ("simple_python", "parallel"), limit=3, max_tokens=200, llm=smollm2_llm
    )
    for category in report["categories"].values():
        assert category["generated"] == 3 and category["calls"] >= 3
        assert category["all_calls_valid"], category["failures"]


def test_jsonschemabench_sample_outputs_validate(smollm2_llm) -> None:
    # Greedy, so the same six outputs each run: three complete (at 84, 52 and 47 tokens) and three were still going
    # at 160 (cut off: a prefix, not judged). The batch decodes until its last row stops, so the budget sets the step
    # count: 112 leaves a third again over the longest completed output and saves 48 steps on the three cut off
    # either way; every output is the same as under 160 up to the budget.
    report = run_jsonschemabench(
        DATA / "jsonschemabench" / "glaiveai2k_with_tests.jsonl",
        "smollm2-135m",
        limit=60,
        generate=6,
        max_tokens=112,
        llm=smollm2_llm,
    )
    assert report["supported"] >= 50
    assert report["completed"] >= 3
    assert report["all_completed_valid"], report["invalid"]


def test_bfcl_types_and_matching() -> None:
    assert bfcl_schema(
        {"type": "dict", "properties": {"a": {"type": "float"}, "b": {"type": "tuple", "items": {"type": "any"}}}}
    ) == {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "array", "items": {}}}}
    truth = [{"f": {"x": [1], "unit": ["cm", ""]}}, {"g": {"name": ["New York"]}}]
    assert bfcl_matches([("g", {"name": "new york"}), ("f", {"x": 1.0})], truth)
    assert not bfcl_matches([("f", {"x": 2}), ("g", {"name": "New York"})], truth)
    assert not bfcl_matches([("f", {"x": 1, "extra": 0}), ("g", {"name": "New York"})], truth)
    assert not bfcl_matches([("f", {"x": 1})], truth)
