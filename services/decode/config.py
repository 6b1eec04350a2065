"""Decode settings: the compute worker's, plus how long a pushed request waits for its follower and the bulk
lane that takes pushes."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.compute.settings import WorkerSettings
from mesh.config import LaneSettings, check_lane_settings, require, require_data_port, setting


@dataclass(frozen=True)
class DecodeSettings(WorkerSettings, LaneSettings):
    stream_attach_timeout_s: float = setting(30.0, "seconds; a pushed request nobody follows by then is aborted")
    data_port: int = setting(
        0, "the bulk lane for KV pushes (TCP beside gRPC, `mesh.lane`): 0 any free port, -1 none (PushKV only)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.stream_attach_timeout_s > 0,
            "stream_attach_timeout_s",
            self.stream_attach_timeout_s,
            "must be positive",
        )
        require_data_port(self.data_port)
        check_lane_settings(self)
