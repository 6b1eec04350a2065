"""A rollout's traffic split: which requests a model's canary version serves.

A conversation keeps its side: its bucket (0..99) is a hash of the tenant and the key of the prompt's block at
`STICKY_BLOCKS` deep (or its last full block, when shorter). Every turn of a conversation past that depth shares
that key (a key chains all the blocks before it, and the tenant's cache salt), so its prefix cache stays on one
side; the first block alone would not do, since every conversation behind one system prompt shares it. Buckets
below the weight go to the canary. A prompt shorter than one block has no cache to keep and hashes its request id.
The price: conversations that share their first `STICKY_BLOCKS` blocks share a side, and a short conversation's
turns may change sides until they reach that depth.

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
STICKY_BLOCKS = 16  # 256 tokens in blocks of 16: past most chat templates' and system prompts' shared prefix


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
    """0..99, the same for every turn of a conversation past STICKY_BLOCKS blocks."""
    blocks = request.block_hashes
    key = blocks[min(len(blocks), STICKY_BLOCKS) - 1] if blocks else request.request_id.encode()
    digest = hashlib.blake2b(request.tenant.encode() + b"\0" + key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % NUM_BUCKETS


def is_canary_request(split: Split, request: RouteRequest) -> bool:
    return bucket(request) < split.weight


def side_of(split: Split, request: RouteRequest, pool: Sequence[WorkerState]) -> list[WorkerState]:
    """The workers of `pool` (one model's, in worker-id order) on the request's side of the split, excluded
    workers left out; the other side's when its own has none."""
    return side(split, is_canary_request(split, request), request, pool)


def side(split: Split, is_canary: bool, request: RouteRequest, pool: Sequence[WorkerState]) -> list[WorkerState]:
    """The workers of `pool` on one side of the split (late binding: the side the route chose, carried to the
    binding), excluded workers left out; the other side's when that one has none."""
    available = [w for w in pool if w.worker_id not in request.exclude_worker_ids]
    canary = [w for w in available if w.version == split.canary_version]
    stable = [w for w in available if w.version != split.canary_version]
    preferred, other = (canary, stable) if is_canary else (stable, canary)
    return preferred or other
