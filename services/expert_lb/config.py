"""expert_lb settings: ServiceSettings plus how often it plans, over how long a window, and how boldly.

Workers report only when KVMESH_EXPERT_REPORT_STEPS > 0 (their setting); without reports this role plans nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import ServiceSettings, require, setting
from mesh.eplb import POLICIES


@dataclass(frozen=True)
class ExpertLBSettings(ServiceSettings):
    expert_plan_interval_s: float = setting(10.0, "seconds between plans (each only when loads changed enough)")
    expert_window_intervals: int = setting(6, "the moving window: the loads of this many last intervals, summed")
    expert_policy: str = setting(
        "auto",
        "auto (hierarchical when num_groups % num_nodes == 0 and there are several nodes), hierarchical or global",
    )
    expert_num_nodes: int = setting(
        1, "nodes a worker's expert-parallel GPUs sit on (hierarchical keeps a group on one)"
    )
    expert_max_moves_fraction: float = setting(
        0.05, "per plan and layer, at most this share of slots change (1: no limit)"
    )
    expert_min_gain: float = setting(0.01, "a layer keeps its placement when moves would gain less balancedness")
    expert_replan_gain: float = setting(0.05, "a full plan (more moves) only when it beats the limited one by more")
    expert_min_window_tokens: int = setting(1, "no plan for a layer before its window holds this many routed tokens")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.expert_plan_interval_s > 0, "expert_plan_interval_s", self.expert_plan_interval_s, "must be positive"
        )
        require(
            self.expert_window_intervals > 0,
            "expert_window_intervals",
            self.expert_window_intervals,
            "must be positive",
        )
        require(
            self.expert_policy in POLICIES, "expert_policy", self.expert_policy, f"must be one of {', '.join(POLICIES)}"
        )
        require(self.expert_num_nodes > 0, "expert_num_nodes", self.expert_num_nodes, "must be positive")
        require(
            0 < self.expert_max_moves_fraction <= 1,
            "expert_max_moves_fraction",
            self.expert_max_moves_fraction,
            "must be in (0, 1]",
        )
        for name in ("expert_min_gain", "expert_replan_gain"):
            value = getattr(self, name)
            require(0 <= value <= 1, name, value, "must be in [0, 1]")
        require(
            self.expert_min_window_tokens > 0,
            "expert_min_window_tokens",
            self.expert_min_window_tokens,
            "must be positive",
        )
