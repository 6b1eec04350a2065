"""Prefill settings: the compute worker's, plus how it uses the KV store."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.compute.settings import WorkerSettings
from mesh.config import SettingError, env_name, require, setting
from mesh.erasure import Protection
from mesh.protection_price import PricedProtection
from services.prefill.fetch_decision import FETCH_MODES


@dataclass(frozen=True)
class PrefillSettings(WorkerSettings):
    kvcache_enabled: bool = setting(True, "read prefixes from and write new blocks to the KV store nodes heard on NATS")
    store_write_queue_bytes: int = setting(
        256 * 2**20, "blocks waiting to be written to the store; more are dropped, never waited for"
    )
    kv_protection: str = setting(
        "1+0", "k+m: each block as k data + m parity fragments on k+m store nodes (1+2: three copies; DeepSeek 10+2)"
    )
    kv_protection_levels: str = setting(
        "",
        "k+m levels, comma separated (e.g. 1+0,7+1,4+1,2+1,1+1,1+2): each block gets one by its recompute price "
        "(tokens x depth x reuse likelihood) within KVMESH_KV_PROTECTION_BUDGET, replacing KVMESH_KV_PROTECTION "
        "(empty: that one level for all; docs/kvcache.md)",
    )
    kv_protection_budget: float = setting(
        1.1, "with KVMESH_KV_PROTECTION_LEVELS: bytes stored per block byte over the blocks written (1.0: no parity)"
    )
    kv_index_enabled: bool = setting(True, "find blocks in the store through the global KV index (JetStream replay)")
    kv_stream_layers: bool = setting(True, "with the index: stream hits layer-major into the engine while it computes")
    kv_store_lanes: bool = setting(
        True, "read and write the store over its nodes' bulk lanes (plain TCP) where they have one, else gRPC"
    )
    kv_fetch: str = setting(
        "auto",
        "a cached prefix the KV store holds: auto (read it, or the part of it, when predicted quicker than "
        "computing it, from measured read and compute rates), always (read it all), never (compute it)",
    )
    kv_push_lanes: bool = setting(True, "push KV to decode over its bulk lane where it has one, else Decode.PushKV")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.store_write_queue_bytes > 0,
            "store_write_queue_bytes",
            self.store_write_queue_bytes,
            "must be positive",
        )
        require(self.kv_fetch in FETCH_MODES, "kv_fetch", self.kv_fetch, f"must be one of {', '.join(FETCH_MODES)}")
        try:
            Protection.parse(self.kv_protection)
        except ValueError as exc:
            require(False, "kv_protection", self.kv_protection, str(exc))
        self.priced_protection()

    def priced_protection(self) -> PricedProtection | None:
        """The levels and budget, checked (a SettingError names the setting at fault); None when not set."""
        if not self.kv_protection_levels.strip():
            return None
        names = (env_name("kv_protection_levels"), env_name("kv_protection_budget"))
        try:
            return PricedProtection.parse(self.kv_protection_levels, self.kv_protection_budget, names=names)
        except ValueError as exc:
            raise SettingError(str(exc)) from None
