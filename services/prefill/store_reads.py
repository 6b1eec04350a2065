"""Reads from the KV store as a prefill worker plans and checks them: the types that the whole-block reads
(`StoreClient.fetch`, store_client.py) and the layer-major reads (`LayerStream`, store_stream.py) share.

A read is planned per block as the k sources to ask (`plan_reads`), gathers the checked fragments that arrive
(`Fetched`), and ends in whole blocks decoded and checked against the block's checksum (`assemble`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc.aio

from mesh import erasure, metrics
from mesh.kv_blocks import checksum, layout_from_proto
from mesh.lane import BufferPool, LanePool
from mesh.logging import get_logger
from mesh.pb import kvcache_pb2, kvcache_pb2_grpc
from services.prefill.prefiller import StoreBlock

log = get_logger(__name__)


@dataclass(frozen=True)
class Source:
    """A node holding one fragment of a block."""

    node: str
    fragment_index: int
    is_host: bool  # in host memory (else SSD, or not known)


@dataclass
class Fetched:
    """The checked fragments of one block that arrived, by fragment index."""

    pieces: dict[int, bytes] = field(default_factory=dict)
    meta: kvcache_pb2.Block | None = None  # one of them, without its data


def plan_reads(sources: Sequence[Sequence[Source]], num_data: Sequence[int]) -> list[list[Source]]:
    """For each key in order, the k sources to read: distinct fragments, data fragments first (no decoding),
    then host memory before SSD. Ends before the first key with fewer than k distinct fragments."""
    plan: list[list[Source]] = []
    for key_sources, k in zip(sources, num_data, strict=True):
        ordered = sorted(key_sources, key=lambda s: (s.fragment_index >= k, not s.is_host))
        chosen: dict[int, Source] = {}
        for source in ordered:
            chosen.setdefault(source.fragment_index, source)
        if len(chosen) < k:
            break
        plan.append(list(chosen.values())[:k])
    return plan


def is_complete(entry: Fetched | None) -> bool:
    """Whether enough fragments of the block arrived to decode it."""
    return entry is not None and entry.meta is not None and len(entry.pieces) >= max(entry.meta.num_data_fragments, 1)


def assemble(keys: Sequence[bytes], fetched: dict[bytes, Fetched]) -> list[StoreBlock]:
    """Decode each block from its fragments, in order, up to the first one missing or failing its checksum.
    CPU work (decoding parity, checksums): callers run it off the event loop."""
    blocks: list[StoreBlock] = []
    for key in keys:
        entry = fetched.get(key)
        if not is_complete(entry):
            break
        assert entry is not None and entry.meta is not None
        meta = entry.meta
        layout = layout_from_proto(meta.layout)
        k, n = max(meta.num_data_fragments, 1), max(meta.num_fragments, 1)
        try:  # KVLayoutError (a ValueError) for a block format this code cannot read: a miss
            data = erasure.decode(entry.pieces, k, n, layout.num_block_bytes)
        except (ValueError, KeyError):
            break
        if checksum(data) != meta.block_checksum:
            metrics.PREFILL_STORE_ERRORS.labels(op="checksum").inc()
            log.warning("store block fails its checksum after decoding", block_hash=key.hex()[:16])
            break
        blocks.append(StoreBlock(key, meta.parent_hash, layout, data))
    return blocks


def store_failed(op: str, address: str, exc: grpc.aio.AioRpcError) -> None:
    """A store call that failed: counted and logged, and a miss for the caller (never a failed request)."""
    metrics.PREFILL_STORE_ERRORS.labels(op=op).inc()
    log.warning(
        "KV store call failed; treated as a miss", op=op, node=address, code=exc.code().name, details=exc.details()
    )


class FragmentReader(Protocol):
    """What a layer-major read needs from the store client (StoreClient implements it): the live nodes, a way
    to call each, and the whole-block reads it falls back on when a node fails mid-stream."""

    timeout_s: float
    lanes: LanePool
    read_buffers: BufferPool

    def nodes(self) -> dict[str, str]:
        """Live store nodes: worker id -> gRPC address."""
        ...

    def lane_addresses(self) -> dict[str, str]:
        """Live store nodes with a bulk lane: worker id -> its address (empty when lanes are off)."""
        ...

    def stub(self, address: str) -> kvcache_pb2_grpc.KVCacheStub: ...

    def sources_from_index(self, keys: Sequence[bytes], nodes: dict[str, str]) -> tuple[list[list[Source]], list[int]]:
        """Each leading key's sources and k, as the global index knows them (ends at the first key it lacks)."""
        ...

    async def read_planned(
        self,
        model: str,
        keys: Sequence[bytes],
        plan: Sequence[Sequence[Source]],
        nodes: dict[str, str],
        fetched: dict[bytes, Fetched] | None = None,
    ) -> dict[bytes, Fetched]:
        """Read the planned fragments from their nodes, in parallel; what arrived and passed its checksum."""
        ...
