"""The global KV index: which worker holds each block, in which tiers, and which erasure-coded fragment of it.

Built only from KV event batches (`apply`), in the order each worker published them: every tier of every worker
publishes on kvmesh.kv.<worker_id>, and the JetStream stream KVMESH_KV keeps them, so a follower that starts late
replays the stream from the beginning and ends up with the same index (`mesh.kv_stream.KVEventFollower`).

The index may lag or miss a batch (a seq gap): that costs at most a cache miss or a wasted fetch, never a wrong
answer, because keys are content hashes and every fetched block is checked (its checksum, its layout) before use.
One writer: the follower's callback (or the owner's explicit calls); readers get copies or plain answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from mesh.pb import events_pb2

TIER_BITS = {"device": 1, "host": 2, "ssd": 4}
STORE_TIERS = TIER_BITS["host"] | TIER_BITS["ssd"]  # the KV store nodes' tiers
ALL_TIERS = TIER_BITS["device"] | STORE_TIERS


def tier_mask(tiers: Iterable[str] | None) -> int:
    """The TIER_BITS of `tiers` (None: every tier)."""
    return ALL_TIERS if tiers is None else sum(TIER_BITS[tier] for tier in set(tiers))


class Holding(NamedTuple):  # tuples: a million of them build and hash fast, in C
    """What one worker holds of one block."""

    fragment_index: int  # 0 for a whole block
    tier_mask: int  # TIER_BITS of the tiers it is in

    def has_tier(self, tier: str) -> bool:
        return bool(self.tier_mask & TIER_BITS.get(tier, 0))


class Coding(NamedTuple):
    num_data: int  # k: any k distinct fragments give the block back (1: whole blocks, maybe replicated)
    num_total: int  # k + m


WHOLE = Coding(1, 1)


class GlobalKVIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, dict[str, Holding]] = {}  # key -> worker id -> holding
        self._coding: dict[bytes, Coding] = {}  # key -> how it is coded (only for fragments)
        self._by_worker: dict[str, set[bytes]] = {}
        self._last_seq: dict[str, int] = {}
        self.num_batches = 0
        self.num_missed_batches = 0

    # -- writes ---------------------------------------------------------------------------------------------
    def apply(self, batch: events_pb2.KVEventBatch, worker_id: str = "") -> int:
        """One batch, its events in order; returns how many batches of its worker were missed before it."""
        worker_id = worker_id or batch.worker_id
        num_missed = self.check_seq(worker_id, batch.seq)
        bit = TIER_BITS.get(batch.tier, TIER_BITS["device"])
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                self._stored(worker_id, event.stored, bit)
            elif kind == "removed":
                self._removed(worker_id, event.removed.block_hashes, bit)
            elif kind == "all_cleared" and event.all_cleared:
                self.clear(worker_id)
        self.num_batches += 1
        self.num_missed_batches += num_missed
        return num_missed

    def check_seq(self, worker_id: str, seq: int) -> int:
        """Record batch `seq`; returns how many were skipped before it (0 in order and for a first batch). A seq
        that does not increase means the worker started over (a new process): what was known of it is forgotten."""
        last = self._last_seq.get(worker_id)
        self._last_seq[worker_id] = seq
        if last is None:
            return 0
        if seq <= last:
            self.clear(worker_id)
            return 0
        return seq - last - 1

    def add(self, worker_id: str, block_hashes: Iterable[bytes], tier: str = "device") -> None:
        stored = events_pb2.KVBlocksStored(block_hashes=block_hashes)
        self._stored(worker_id, stored, TIER_BITS[tier])

    def remove(self, worker_id: str, block_hashes: Iterable[bytes], tier: str = "device") -> None:
        self._removed(worker_id, block_hashes, TIER_BITS[tier])

    def clear(self, worker_id: str) -> None:
        for key in self._by_worker.pop(worker_id, set()):
            self._drop_holding(key, worker_id)

    def drop(self, worker_id: str) -> None:
        """The worker left the mesh for good: forget its blocks and its event numbering."""
        self.clear(worker_id)
        self._last_seq.pop(worker_id, None)

    def reset(self) -> None:
        """Forget everything (before a snapshot is restored)."""
        self._holders.clear()
        self._coding.clear()
        self._by_worker.clear()
        self._last_seq.clear()

    # -- snapshots ------------------------------------------------------------------------------------------
    def to_snapshot(self, stream_seq: int) -> events_pb2.KVIndexSnapshot:
        """The whole index as the snapshot of the stream up to `stream_seq` (the caller's last applied message)."""
        coding_ids: dict[Coding, int] = {}
        workers = []
        for worker_id in sorted(self._by_worker.keys() | self._last_seq.keys()):
            keys = sorted(self._by_worker.get(worker_id, ()))
            holdings = [self._holders[key][worker_id] for key in keys]
            codings = [self._coding.get(key) for key in keys]
            workers.append(
                events_pb2.WorkerHoldings(
                    worker_id=worker_id,
                    last_seq=self._last_seq.get(worker_id, 0),
                    block_hashes=keys,
                    fragment_indices=[h.fragment_index for h in holdings],
                    tier_masks=[h.tier_mask for h in holdings],
                    coding_ids=[0 if c is None else coding_ids.setdefault(c, len(coding_ids) + 1) for c in codings],
                )
            )
        return events_pb2.KVIndexSnapshot(
            stream_seq=stream_seq,
            workers=workers,
            codings=[events_pb2.BlockCoding(num_data=c.num_data, num_total=c.num_total) for c in coding_ids],
        )

    def restore(self, snapshot: events_pb2.KVIndexSnapshot, tier_mask: int = ALL_TIERS) -> None:
        """Replace the index by `snapshot`, keeping only holdings in `tier_mask`'s tiers (every worker's batch
        numbering is kept whatever its tiers: a follower's filter never changes a worker's seq)."""
        self.reset()
        codings = [None, *(Coding(c.num_data, c.num_total) for c in snapshot.codings)]
        holders, coding_of = self._holders, self._coding
        for worker in snapshot.workers:
            worker_id = worker.worker_id
            if worker.last_seq:
                self._last_seq[worker_id] = worker.last_seq
            held: set[bytes] = set()
            for key, index, mask, coding_id in zip(
                worker.block_hashes, worker.fragment_indices, worker.tier_masks, worker.coding_ids, strict=True
            ):
                if mask & tier_mask:
                    holders.setdefault(key, {})[worker_id] = Holding(index, mask & tier_mask)
                    held.add(key)
                    coding = codings[coding_id]
                    if coding is not None:
                        coding_of[key] = coding
            if held:
                self._by_worker[worker_id] = held

    def _stored(self, worker_id: str, stored: events_pb2.KVBlocksStored, bit: int) -> None:
        indices = list(stored.fragment_indices)
        coding = Coding(stored.num_data_fragments, stored.num_fragments) if stored.num_fragments > 1 else None
        held = self._by_worker.setdefault(worker_id, set())
        for n, key in enumerate(stored.block_hashes):
            holders = self._holders.setdefault(key, {})
            old = holders.get(worker_id)
            index = indices[n] if n < len(indices) else 0
            holders[worker_id] = Holding(index, (old.tier_mask if old is not None else 0) | bit)
            if coding is not None:
                self._coding[key] = coding
            held.add(key)

    def _removed(self, worker_id: str, block_hashes: Iterable[bytes], bit: int) -> None:
        for key in block_hashes:
            holding = self._holders.get(key, {}).get(worker_id)
            if holding is None:
                continue
            mask = holding.tier_mask & ~bit
            if mask:
                self._holders[key][worker_id] = Holding(holding.fragment_index, mask)
            else:
                self._drop_holding(key, worker_id)
                self._by_worker.get(worker_id, set()).discard(key)

    def _drop_holding(self, key: bytes, worker_id: str) -> None:
        holders = self._holders.get(key)
        if holders is None:
            return
        holders.pop(worker_id, None)
        if not holders:
            del self._holders[key]
            self._coding.pop(key, None)

    # -- reads ----------------------------------------------------------------------------------------------
    def holders(self, key: bytes) -> Mapping[str, Holding]:
        return dict(self._holders.get(key, {}))

    def coding(self, key: bytes) -> Coding:
        return self._coding.get(key, WHOLE)

    def keys_of(self, worker_id: str) -> list[bytes]:
        return list(self._by_worker.get(worker_id, ()))

    def num_blocks(self, worker_id: str | None = None) -> int:
        if worker_id is None:
            return len(self._holders)
        return len(self._by_worker.get(worker_id, ()))

    def holds(self, worker_id: str, key: bytes) -> bool:
        return key in self._by_worker.get(worker_id, ())

    def num_leading_hits(self, worker_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, the worker holds (a prefix is usable only up to a gap)."""
        held = self._by_worker.get(worker_id)
        if not held:
            return 0
        return next((n for n, key in enumerate(block_hashes) if key not in held), len(block_hashes))

    def leading_hits_by_worker(self, block_hashes: Sequence[bytes], tier: str = "device") -> dict[str, int]:
        """For every worker holding the first block in `tier`: how many blocks from the first it holds there (the
        balancer's question, for all workers in one walk)."""
        bit = TIER_BITS[tier]
        counts: dict[str, int] = {}
        active: set[str] | None = None
        for n, key in enumerate(block_hashes, start=1):
            holders = self._holders.get(key)
            if not holders:
                break
            held = {w for w, h in holders.items() if h.tier_mask & bit and (active is None or w in active)}
            if not held:
                break
            for worker_id in held:
                counts[worker_id] = n
            active = held
        return counts

    def num_leading_stored(self, block_hashes: Sequence[bytes], start: int = 0) -> tuple[int, int]:
        """(host, ssd): how many blocks from `block_hashes[start]` on, without a gap, store nodes can serve, and
        from which tier (host when k distinct fragments are in host memory somewhere, else SSD)."""
        num_host = num_ssd = 0
        for key in block_hashes[start:]:
            holders = self._holders.get(key)
            if not holders:
                break
            need = self._coding.get(key, WHOLE).num_data
            in_host = {h.fragment_index for h in holders.values() if h.tier_mask & TIER_BITS["host"]}
            if len(in_host) >= need:
                num_host += 1
                continue
            stored = {h.fragment_index for h in holders.values() if h.tier_mask & STORE_TIERS}
            if len(stored) < need:
                break
            num_ssd += 1
        return num_host, num_ssd

    def num_readable(self, key: bytes, workers: Iterable[str]) -> int:
        """Distinct fragments of `key` held by `workers` (the live ones): the block is readable at >= k."""
        holders = self._holders.get(key, {})
        return len({holders[w].fragment_index for w in workers if w in holders})
