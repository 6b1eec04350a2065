"""KV cache settings: ServiceSettings plus the tiers, the eviction policy, TTLs by traffic class and repair."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mesh.config import LaneSettings, ServiceSettings, check_lane_settings, require, require_data_port, setting
from mesh.eviction.policies import DEFAULT_POLICY, POLICIES
from services.kvcache.store import DAY_S, StoreConfig


def parse_ttls(text: str) -> dict[str, float]:
    """ "agent=259200,chat=604800" -> {"agent": 259200.0, "chat": 604800.0} (seconds)."""
    ttls = {}
    for part in text.split(","):
        if part.strip():
            name, _, seconds = part.partition("=")
            ttls[name.strip()] = float(seconds)
    return ttls


@dataclass(frozen=True)
class KVCacheSettings(ServiceSettings, LaneSettings):
    capacity_bytes: int = setting(2**30, "host memory for block data")
    data_dir: str = setting(
        "",
        "the SSD tier's directory: block files go to <data_dir>/<worker_id>, read back after a restart "
        "(empty: host memory only)",
    )
    ssd_capacity_bytes: int = setting(16 * 2**30, "the SSD tier's size")
    eviction_policy: str = setting(DEFAULT_POLICY, "the eviction policy: " + ", ".join(POLICIES))
    ttls: str = setting(
        f"agent={3 * DAY_S:.0f},chat={7 * DAY_S:.0f}",
        "TTL in seconds per traffic class: class=seconds, comma separated",
    )
    default_traffic_class: str = setting(
        "chat", "the class of blocks put without one (or with an unknown one): they live this long"
    )
    expire_interval_s: float = setting(10.0, "seconds between checks of TTLs and pins")
    repair_interval_s: float = setting(
        5.0, "seconds between checks that the blocks this node leads are fully protected"
    )
    repair_delay_s: float = setting(30.0, "seconds a node may be gone before its fragments are rebuilt elsewhere")
    data_port: int = setting(
        0,
        "the bulk lane for the store's reads and writes (TCP beside gRPC, `mesh.lane`): 0 any free port, -1 none",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.capacity_bytes > 0, "capacity_bytes", self.capacity_bytes, "must be positive")
        require(self.ssd_capacity_bytes > 0, "ssd_capacity_bytes", self.ssd_capacity_bytes, "must be positive")
        require(
            self.eviction_policy in POLICIES,
            "eviction_policy",
            self.eviction_policy,
            f"must be one of {', '.join(POLICIES)}",
        )
        try:
            ttls = parse_ttls(self.ttls)
        except ValueError:
            ttls = {}
        require(
            bool(ttls) and all(v > 0 for v in ttls.values()),
            "ttls",
            self.ttls,
            "must be class=seconds pairs, comma separated, each positive",
        )
        require(
            self.default_traffic_class in ttls,
            "default_traffic_class",
            self.default_traffic_class,
            "must be one of the classes in KVMESH_TTLS",
        )
        for name in ("expire_interval_s", "repair_interval_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be positive")
        require_data_port(self.data_port)
        check_lane_settings(self)
        require(self.repair_delay_s >= 0, "repair_delay_s", self.repair_delay_s, "must not be negative")

    def store_config(self, worker_id: str) -> StoreConfig:
        ssd_dir = Path(self.data_dir) / worker_id if self.data_dir else None
        return StoreConfig(
            host_capacity_bytes=self.capacity_bytes,
            ssd_dir=ssd_dir,
            ssd_capacity_bytes=self.ssd_capacity_bytes,
            policy=self.eviction_policy,
            ttl_s=parse_ttls(self.ttls),
            default_class=self.default_traffic_class,
        )
