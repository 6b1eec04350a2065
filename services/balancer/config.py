"""Balancer settings: ServiceSettings plus the router's tie-break window (KVMESH_NUM_RECENT_ROUTES).

Workers are dropped after three missed intervals of KVMESH_HEARTBEAT_INTERVAL_S, the same setting the workers
beat with.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import ServiceSettings, require


@dataclass(frozen=True)
class BalancerSettings(ServiceSettings):
    num_recent_routes: int = 64  # prefill ties go to the worker picked least often among this many last routes

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_recent_routes > 0, "num_recent_routes", self.num_recent_routes, "must be positive")
