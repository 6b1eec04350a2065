"""Decode settings: the compute worker's, plus how long a pushed request waits for its follower and the bulk
lane that takes pushes."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.compute.settings import WorkerSettings
from mesh.config import require, require_data_port


@dataclass(frozen=True)
class DecodeSettings(WorkerSettings):
    stream_attach_timeout_s: float = 30.0  # a pushed request nobody follows within this is aborted
    data_port: int = 0  # the bulk lane for KV pushes (plain TCP, mesh.lane): 0 any free port, -1 none (PushKV only)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.stream_attach_timeout_s > 0,
            "stream_attach_timeout_s",
            self.stream_attach_timeout_s,
            "must be positive",
        )
        require_data_port(self.data_port)
