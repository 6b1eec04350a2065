"""Prefill settings: the compute worker's, plus how it uses the KV store."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import require
from services.compute.settings import WorkerSettings


@dataclass(frozen=True)
class PrefillSettings(WorkerSettings):
    kvcache_enabled: bool = True  # read prefixes from and write new blocks to the KV store nodes heard on NATS
    store_write_queue_bytes: int = 256 * 2**20  # blocks waiting to be written to the store; more are dropped

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.store_write_queue_bytes > 0, "store_write_queue_bytes", self.store_write_queue_bytes,
                "must be positive")
