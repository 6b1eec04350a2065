"""`kvmesh expert-plan --input FILE`: an expert placement planned offline from a load matrix (mesh.eplb).

The input is JSON with EPLB's arguments — `weight` (layers x experts), `num_replicas`, `num_groups`,
`num_nodes`, `num_gpus` — at the top level or under `inputs` (so EPLB's README example reads as it is), and
optionally the current placement (`phy2log` or `current`, layers x replicas): then `num_moved` counts against
it, and --max-moves limits the change per layer (strictly, unless --replan-gain lets a full plan through when
it gains more balancedness than that). The output is the plan's JSON: `phy2log`, `gpu_loads`,
`max_gpu_load` and `balancedness` per layer, `num_moved`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mesh import eplb


def read_input(path: str | Path) -> dict[str, Any]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    inputs = raw.get("inputs", raw)
    if not isinstance(inputs, dict):
        raise ValueError(f"{path}: `inputs` must be an object")
    missing = [k for k in ("weight", "num_replicas", "num_groups", "num_nodes", "num_gpus") if k not in inputs]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    return inputs


def plan_from_input(
    inputs: dict[str, Any], policy: str = "auto", max_moves: int | None = None, replan_gain: float = 1.0
) -> dict[str, Any]:
    """The plan of one input object, as JSON-ready data. ValueError for inputs that do not fit together."""
    topology = eplb.Topology(inputs["num_replicas"], inputs["num_groups"], inputs["num_nodes"], inputs["num_gpus"])
    current = inputs.get("phy2log", inputs.get("current"))
    if max_moves is not None and current is None:
        raise ValueError("--max-moves needs the current placement (`phy2log` or `current` in the input)")
    options = eplb.PlanOptions(policy=policy, max_moves=max_moves, replan_gain=replan_gain)
    plan = eplb.rebalance(inputs["weight"], topology, current, options)
    return plan.to_json()


def run(path: str, policy: str = "auto", max_moves: int | None = None, replan_gain: float = 1.0) -> dict[str, Any]:
    return plan_from_input(read_input(path), policy, max_moves, replan_gain)
