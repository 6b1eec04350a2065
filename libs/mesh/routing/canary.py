"""A rollout's traffic split: which requests a model's canary version serves.

A conversation keeps its side for the whole rollout step: its bucket (0..99) is a hash of the tenant and the
prompt's first block key, which every turn of a conversation shares (and which already carries the tenant's cache
salt), so its prefix cache stays on one side. Buckets below the weight go to the canary. A prompt shorter than one
block has no cache to keep and hashes its request id instead.

Neither side ever leaves a request without a worker: a canary side with nobody (not started yet, drained, all
excluded after failures) sends its requests to the stable workers, and a stable side with nobody (after a
promotion) to the canary's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from mesh.routing.state import RouteRequest, WorkerState

NUM_BUCKETS = 100


@dataclass(frozen=True)
class Split:
    """One model's split during a rollout: `weight` percent of its conversations go to `canary_version`; every
    worker of another version is stable."""

    model: str
    canary_version: str
    weight: int  # 0..100

    def __post_init__(self) -> None:
        if not 0 <= self.weight <= 100:
            raise ValueError(f"weight must be from 0 to 100, got {self.weight}")
        if not self.canary_version:
            raise ValueError("canary_version is required")


def bucket(request: RouteRequest) -> int:
    """0..99, the same for every turn of a conversation (the tenant and the prompt's first block key)."""
    key = request.block_hashes[0] if request.block_hashes else request.request_id.encode()
    digest = hashlib.blake2b(request.tenant.encode() + b"\0" + key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % NUM_BUCKETS


def is_canary_request(split: Split, request: RouteRequest) -> bool:
    return bucket(request) < split.weight


def side_of(split: Split, request: RouteRequest, pool: Sequence[WorkerState]) -> list[WorkerState]:
    """The workers of `pool` (one model's, in worker-id order) on the request's side of the split, excluded
    workers left out; the other side's when its own has none."""
    available = [w for w in pool if w.worker_id not in request.exclude_worker_ids]
    canary = [w for w in available if w.version == split.canary_version]
    stable = [w for w in available if w.version != split.canary_version]
    preferred, other = (canary, stable) if is_canary_request(split, request) else (stable, canary)
    return preferred or other
