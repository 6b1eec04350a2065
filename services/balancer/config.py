"""Balancer settings: ServiceSettings plus the routing policy and its cost model's scale.

    KVMESH_BALANCER_POLICY               round_robin | least_load | cache_aware | kv_aware | deepseek | kvmesh (default)
    KVMESH_BALANCER_COST_SCALE           multiplies the cost model's compute times (1.0: DeepSeek-V3 units on H800;
                                         see docs/balancer.md for fitting it to other hardware)
    KVMESH_BALANCER_SHARE_ASSIGNMENTS    publish each decision on kvmesh.balancer.assign and count peers' (true)
    KVMESH_BALANCER_TARGET_UTILIZATION   the utilization recommended pool sizes aim at (0.8)
    KVMESH_KV_SNAPSHOT_EVERY             snapshot the global KV index and purge the KV event stream below it every
                                         this many stream messages (100000; 0: never), checked every
                                         KVMESH_KV_SNAPSHOT_CHECK_S (10)

Workers are dropped after three missed intervals of KVMESH_HEARTBEAT_INTERVAL_S, the same setting the workers
beat with; the recommended pool sizes are published once per interval.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import ServiceSettings, require
from mesh.routing import DEFAULT_POLICY, POLICIES


@dataclass(frozen=True)
class BalancerSettings(ServiceSettings):
    balancer_policy: str = DEFAULT_POLICY
    balancer_cost_scale: float = 1.0
    balancer_share_assignments: bool = True
    balancer_target_utilization: float = 0.8
    kv_snapshot_every: int = 100_000
    kv_snapshot_check_s: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.balancer_policy in POLICIES,
            "balancer_policy",
            self.balancer_policy,
            f"must be one of {', '.join(POLICIES)}",
        )
        require(self.balancer_cost_scale > 0, "balancer_cost_scale", self.balancer_cost_scale, "must be positive")
        require(
            0 < self.balancer_target_utilization <= 1,
            "balancer_target_utilization",
            self.balancer_target_utilization,
            "must be in (0, 1]",
        )
        require(self.kv_snapshot_every >= 0, "kv_snapshot_every", self.kv_snapshot_every, "must be 0 (never) or more")
        require(self.kv_snapshot_check_s > 0, "kv_snapshot_check_s", self.kv_snapshot_check_s, "must be positive")
