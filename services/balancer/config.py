"""Balancer settings: ServiceSettings plus the routing policy, its cost model's scale, replica sharing and the
KV index snapshots (docs/configuration.md lists them all).

Workers are dropped after three missed intervals of KVMESH_HEARTBEAT_INTERVAL_S, the same setting the workers
beat with; the recommended pool sizes are published once per interval.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import ServiceSettings, require, setting
from mesh.routing import DECODE_BINDINGS, DEFAULT_POLICY, POLICIES


@dataclass(frozen=True)
class BalancerSettings(ServiceSettings):
    balancer_policy: str = setting(DEFAULT_POLICY, "the routing policy: " + ", ".join(POLICIES))
    balancer_decode_binding: str = setting(
        "late",
        "when the decode worker is chosen: late (Route names prefill only; prefill asks BindDecode when the KV is "
        "ready) or early (Route names both, at the arrival); docs/balancer.md",
    )
    balancer_cost_scale: float = setting(
        1.0,
        "multiplies the cost model's compute times (1.0: DeepSeek-V3 units on H800; fitted live from prefill "
        "reports as well; docs/balancer.md)",
    )
    balancer_share_assignments: bool = setting(
        True, "publish each decision on kvmesh.balancer.assign and count the peer replicas'"
    )
    balancer_target_utilization: float = setting(0.8, "the utilization recommended pool sizes aim at")
    kv_snapshot_every: int = setting(
        100_000,
        "snapshot the global KV index and purge the KV event stream below it every this many stream messages "
        "(0: never)",
    )
    kv_snapshot_check_s: float = setting(10.0, "seconds between checks whether a snapshot is due")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.balancer_policy in POLICIES,
            "balancer_policy",
            self.balancer_policy,
            f"must be one of {', '.join(POLICIES)}",
        )
        require(
            self.balancer_decode_binding in DECODE_BINDINGS,
            "balancer_decode_binding",
            self.balancer_decode_binding,
            f"must be one of {', '.join(DECODE_BINDINGS)}",
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
