"""KV cache settings: ServiceSettings plus the store's size (KVMESH_CAPACITY_BYTES)."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import ServiceSettings, require


@dataclass(frozen=True)
class KVCacheSettings(ServiceSettings):
    capacity_bytes: int = 2**30  # host memory for block data; least recently used blocks go first past it

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.capacity_bytes > 0, "capacity_bytes", self.capacity_bytes, "must be positive")
