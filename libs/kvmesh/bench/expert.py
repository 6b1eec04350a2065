"""`kvmesh bench expert`: expert placement on skewed, drifting loads, mesh.eplb against DeepSeek EPLB.

DeepSeek-V3's shape: 256 routed experts in 8 groups, 8 per token, on 32 GPUs in 4 nodes with 32 redundant slots
(288 slots, 9 per GPU). Each MoE layer's expert popularity starts skewed — Zipf (popularity 1/rank^s over a random
order of the experts) or lognormal — and drifts: every interval each expert's log-popularity takes a normal
step. Each interval routes `tokens` tokens x 8 experts per layer, drawn from the popularity, so the counts carry
sampling noise. After each interval every planner plans from the moving window (the last `window` intervals'
counts, summed), as the expert_lb role does, starting from its own previous placement, and is scored:
- balancedness: mean / max GPU load of the plan on the window it planned from (EPLB's measure);
- served: the same on the next interval's counts, the load the placement then meets;
- moved: slots given another expert than in the planner's previous placement (each one expert's weights
  copied), as a share of the 288 slots (the first plan, from the default placement, is not counted).

Planners: ours (mesh.eplb) with each policy — full plans every interval (aligned to the previous placement),
and incremental (never more than 5% of the slots of a layer change per plan, expert_lb's default share) — and
the BASELINE, EPLB's algorithm as published (kvmesh.bench.eplb_reference).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.bench import eplb_reference
from mesh import eplb

NUM_EXPERTS, NUM_GROUPS, TOP_K = 256, 8, 8
NUM_GPUS, NUM_NODES, NUM_REDUNDANT = 32, 4, 32
NUM_SLOTS = NUM_EXPERTS + NUM_REDUNDANT
GOAL_GLOBAL, GOAL_MOVED = 0.95, 0.10

Planner = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]  # (window loads, previous placement) -> phy2log


@dataclass(frozen=True)
class Scenario:
    name: str
    initial: Callable[[np.random.Generator, int], np.ndarray]  # (rng, layers) -> log-popularity (L, E)
    drift: float  # std of each expert's log-popularity step per interval


def zipf(exponent: float) -> Callable[[np.random.Generator, int], np.ndarray]:
    def initial(rng: np.random.Generator, num_layers: int) -> np.ndarray:
        ranks = np.stack([rng.permutation(NUM_EXPERTS) + 1 for _ in range(num_layers)])
        return -exponent * np.log(ranks)

    return initial


def lognormal(sigma: float) -> Callable[[np.random.Generator, int], np.ndarray]:
    def initial(rng: np.random.Generator, num_layers: int) -> np.ndarray:
        return rng.normal(0.0, sigma, (num_layers, NUM_EXPERTS))

    return initial


SCENARIOS = (Scenario("zipf(s=1.0)", zipf(1.0), 0.1), Scenario("lognormal(sigma=1.0)", lognormal(1.0), 0.1))


def intervals(
    scenario: Scenario, rng: np.random.Generator, num_layers: int, num_intervals: int, tokens: int
) -> list[np.ndarray]:
    """Counts (L, E) per interval: tokens x TOP_K pairs per layer drawn from the drifting popularity."""
    log_pop = scenario.initial(rng, num_layers)
    out = []
    for _ in range(num_intervals):
        pop = np.stack([capped(row) for row in np.exp(log_pop - log_pop.max(axis=1, keepdims=True))])
        out.append(np.stack([rng.multinomial(tokens * TOP_K, row) for row in pop]).astype(np.float64))
        log_pop = log_pop + rng.normal(0.0, scenario.drift, log_pop.shape)
    return out


def capped(popularity: np.ndarray) -> np.ndarray:
    """Normalized, no expert above 1/TOP_K: a token picks TOP_K distinct experts, so none gets more of the pairs
    (what is cut goes to the others in proportion)."""
    share = popularity / popularity.sum()
    while share.max() > 1 / TOP_K + 1e-12:
        over = share >= 1 / TOP_K
        share = np.where(over, 1 / TOP_K, share * (1 - over.sum() / TOP_K) / share[~over].sum())
    return share


def ours(policy: str, max_moves: int | None) -> Planner:
    """Full plans (max_moves None), or plans that never change more than max_moves slots per layer."""
    topology = eplb.Topology(NUM_SLOTS, NUM_GROUPS, NUM_NODES, NUM_GPUS)
    options = eplb.PlanOptions(policy=policy, max_moves=max_moves, replan_gain=1.0)

    def plan(weight: np.ndarray, previous: np.ndarray | None) -> np.ndarray:
        return eplb.rebalance(weight, topology, previous, options).phy2log

    return plan


def baseline(policy: str) -> Planner:
    groups, nodes = (NUM_GROUPS, NUM_NODES) if policy == "hierarchical" else (1, 1)

    def plan(weight: np.ndarray, previous: np.ndarray | None) -> np.ndarray:
        return eplb_reference.rebalance_experts(weight, NUM_SLOTS, groups, nodes, NUM_GPUS)

    return plan


def planners() -> dict[str, Planner]:
    limit = int(0.05 * NUM_SLOTS)  # expert_lb's default share
    return {
        "ours-global": ours("global", None),
        "ours-global-incremental": ours("global", limit),
        "eplb-global (baseline)": baseline("global"),
        "ours-hierarchical": ours("hierarchical", None),
        "ours-hierarchical-incremental": ours("hierarchical", limit),
        "eplb-hierarchical (baseline)": baseline("hierarchical"),
    }


def score(counts: list[np.ndarray], planner: Planner, window: int) -> dict[str, Any]:
    balanced: list[float] = []
    served: list[float] = []
    moved: list[float] = []
    recent: deque[np.ndarray] = deque(maxlen=window)
    previous: np.ndarray | None = None
    seconds = 0.0
    for t in range(len(counts) - 1):
        recent.append(counts[t])
        weight = np.sum(recent, axis=0)
        start = time.perf_counter()
        placement = planner(weight, previous)
        seconds += time.perf_counter() - start
        balanced.extend(eplb.balancedness(eplb.gpu_loads(weight, placement, NUM_GPUS)))
        served.extend(eplb.balancedness(eplb.gpu_loads(counts[t + 1], placement, NUM_GPUS)))
        if previous is not None:
            moved.append(float((placement != previous).mean()))
        previous = placement
    return {
        "balancedness": round(float(np.mean(balanced)), 4),
        "balancedness_min": round(float(np.min(balanced)), 4),
        "served": round(float(np.mean(served)), 4),
        "moved_mean": round(float(np.mean(moved)), 4),
        "moved_max": round(float(np.max(moved)), 4),
        "plan_ms_per_layer": round(1000 * seconds / ((len(counts) - 1) * counts[0].shape[0]), 1),
    }


def goals(rows: dict[str, dict[str, dict[str, Any]]]) -> dict[str, bool]:
    ok_global = all(r["ours-global"]["balancedness"] >= GOAL_GLOBAL for r in rows.values())
    ok_eplb = all(
        r[f"ours-{p}"]["balancedness"] >= r[f"eplb-{p} (baseline)"]["balancedness"]
        for r in rows.values()
        for p in ("global", "hierarchical")
    )
    ok_moved = all(
        r[f"ours-{p}-incremental"]["moved_max"] < GOAL_MOVED for r in rows.values() for p in ("global", "hierarchical")
    )
    return {
        "global_balancedness_at_least_0.95": ok_global,
        "at_least_eplb_with_either_policy": ok_eplb,
        "incremental_moves_under_10pct_per_plan": ok_moved,
    }


def run_expert_bench(
    quick: bool = False,
    seed: int = 0,
    num_layers: int | None = None,
    num_intervals: int | None = None,
    tokens: int = 16384,
    window: int = 4,
) -> dict[str, Any]:
    num_layers = num_layers or (2 if quick else 8)
    num_intervals = num_intervals or (6 if quick else 16)
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for i, scenario in enumerate(SCENARIOS):
        counts = intervals(scenario, np.random.default_rng(seed + i), num_layers, num_intervals, tokens)
        rows[scenario.name] = {name: score(counts, planner, window) for name, planner in planners().items()}
    return {
        "setup": {
            "experts": NUM_EXPERTS,
            "groups": NUM_GROUPS,
            "top_k": TOP_K,
            "gpus": NUM_GPUS,
            "nodes": NUM_NODES,
            "slots": NUM_SLOTS,
            "layers": num_layers,
            "intervals": num_intervals,
            "tokens_per_interval": tokens,
            "window_intervals": window,
            "drift": {s.name: s.drift for s in SCENARIOS},
            "seed": seed,
        },
        "results": rows,
        "goals": goals(rows),
    }
