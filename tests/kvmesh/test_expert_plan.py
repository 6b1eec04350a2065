"""`kvmesh expert-plan` on EPLB's README example as it is, and `kvmesh bench expert` in its quick form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.expert import run_expert_bench
from kvmesh.cli import build_parser, main
from kvmesh.up import Mesh, MeshPlan

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "eplb" / "eplb_readme_example.json"  # tests/data/README.md


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["expert-plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_readme_example_plans_no_heavier_than_eplb(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan(capsys, "--input", str(EXAMPLE))
    assert out["policy"] == "hierarchical"
    assert [max(loads) for loads in out["gpu_loads"]] == out["max_gpu_load"]
    assert out["max_gpu_load"][0] <= 156.0 and out["max_gpu_load"][1] <= 179.5  # EPLB's own placement
    assert [len(row) for row in out["phy2log"]] == [16, 16]
    assert [len(loads) for loads in out["gpu_loads"]] == [8, 8]
    assert out["balancedness"] == [round(sum(g) / 8 / max(g), 6) for g in out["gpu_loads"]]
    assert out["num_moved"] == 0
    assert plan(capsys, "--input", str(EXAMPLE), "--policy", "global")["max_gpu_load"] == [136.0, 172.0]


def test_a_current_placement_in_the_input_limits_and_counts_moves(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    inputs = json.loads(EXAMPLE.read_text())["inputs"]
    readme_placement = json.loads(EXAMPLE.read_text())["expected_output_from_readme"]["phy2log"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**inputs, "phy2log": readme_placement}))
    out = plan(capsys, "--input", str(path), "--max-moves", "2", "--policy", "global")
    assert out["num_moved_per_layer"][0] <= 2 and out["num_moved_per_layer"][1] <= 2
    assert out["max_gpu_load"][0] <= 156.0 and out["max_gpu_load"][1] <= 179.5
    unlimited = plan(capsys, "--input", str(path), "--max-moves", "2", "--policy", "global", "--replan-gain", "0")
    assert unlimited["max_gpu_load"] == [136.0, 172.0] and unlimited["num_moved"] > 4


def test_a_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"weight": [[1, 2, 3]], "num_replicas": 4, "num_groups": 1, "num_nodes": 1}))
    assert main(["expert-plan", "--input", str(path)]) == 2
    assert "missing num_gpus" in capsys.readouterr().err


def test_expert_bench_meets_its_goals_quickly() -> None:
    result = run_expert_bench(quick=True)
    assert set(result["results"]) == {"zipf(s=1.0)", "lognormal(sigma=1.0)"}
    for rows in result["results"].values():
        assert set(rows) == {
            "ours-global",
            "ours-global-incremental",
            "eplb-global (baseline)",
            "ours-hierarchical",
            "ours-hierarchical-incremental",
            "eplb-hierarchical (baseline)",
        }
        assert rows["ours-global-incremental"]["moved_max"] <= round(14 / 288, 4)  # 5% of 288 slots per layer
    assert result["goals"] == {
        "global_balancedness_at_least_0.95": True,
        "at_least_eplb_with_either_policy": True,
        "incremental_moves_under_10pct_per_plan": True,
    }


def test_expert_lb_is_a_role_and_up_starts_it_only_for_reporting_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args(["serve", "expert_lb"]).role == "expert_lb"
    monkeypatch.delenv("KVMESH_EXPERT_REPORT_STEPS", raising=False)
    assert Mesh(MeshPlan())._count("expert_lb") == 0
    assert Mesh(MeshPlan(env={"KVMESH_EXPERT_REPORT_STEPS": "0"}))._count("expert_lb") == 0
    assert Mesh(MeshPlan(env={"KVMESH_EXPERT_REPORT_STEPS": "8"}))._count("expert_lb") == 1
    monkeypatch.setenv("KVMESH_EXPERT_REPORT_STEPS", "4")
    assert Mesh(MeshPlan())._count("expert_lb") == 1
