"""BlockStore: a node's KV blocks (or erasure-coded fragments) by key, in host memory and on SSD.

Tiers are write-through: a block put here enters host memory and, when an SSD directory is configured, its file
(the SSD tier is the larger one and survives a restart). Host memory is a cache of the SSD: evicting from it
loses nothing the SSD holds, and a block found only on SSD is promoted back to host memory.
Each tier evicts by its own policy within its byte capacity. Every block also has a deadline, set by its traffic
class's TTL and pushed back by each use; `expire()` removes blocks past it. A pin keeps blocks (no eviction, no
TTL) until the pin expires.

The store is the only writer of its tiers; the KV cache servicer is its only caller (one event loop). Each change
is returned as events (`BlocksStored`, `BlocksRemoved`, per tier) for the servicer to publish, so a global index
can follow the store. The clock is injected (wall-clock seconds: deadlines outlive a restart through the files'
modification times).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from mesh.eviction.hint import NO_HINT, BlockHint
from mesh.eviction.policies import DEFAULT_POLICY, make_policy
from services.kvcache.blocks import (
    WHOLE,
    Block,
    BlockError,
    BlocksRemoved,
    BlocksStored,
    Fragment,
    StoreEvent,
    append_removed,
    append_stored,
    rejection,
)
from services.kvcache.tiers import FileTier, MemoryTier

DAY_S = 86_400.0
DEFAULT_TTL_S = MappingProxyType({"agent": 3 * DAY_S, "chat": 7 * DAY_S})

__all__ = [
    "WHOLE",
    "Block",
    "BlockError",
    "BlockStore",
    "BlocksRemoved",
    "BlocksStored",
    "Fragment",
    "StoreConfig",
    "StoreEvent",
]

Tier = MemoryTier | FileTier


@dataclass(frozen=True)
class StoreConfig:
    host_capacity_bytes: int
    ssd_dir: Path | None = None  # None: host memory only
    ssd_capacity_bytes: int = 0
    policy: str = DEFAULT_POLICY
    ttl_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TTL_S))  # traffic class -> TTL
    default_class: str = "chat"  # for blocks put without a class, or with one not in ttl_s

    def __post_init__(self) -> None:
        assert self.host_capacity_bytes > 0 and (self.ssd_dir is None or self.ssd_capacity_bytes > 0)
        assert self.default_class in self.ttl_s, "the default class needs a TTL"


@dataclass
class PutResult:
    num_stored: int = 0
    num_present: int = 0  # already held (their recency and deadline are refreshed)
    rejections: list[str] = field(default_factory=list)  # one reason per block not taken
    events: list[StoreEvent] = field(default_factory=list)  # in the order the changes happened


@dataclass
class GetResult:
    blocks: list[tuple[Block, str]] = field(default_factory=list)  # (block, the tier it was found in)
    events: list[StoreEvent] = field(default_factory=list)  # promotions, and what they or TTLs evicted


@dataclass(frozen=True)
class TierStats:
    num_blocks: int
    num_bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class StoreStats:
    tiers: dict[str, TierStats]
    num_pinned: int


class BlockStore:
    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.host = MemoryTier(config.host_capacity_bytes, make_policy(config.policy, config.host_capacity_bytes))
        self.ssd: FileTier | None = None
        if config.ssd_dir is not None:
            self.ssd = FileTier(
                config.ssd_dir, config.ssd_capacity_bytes, make_policy(config.policy, config.ssd_capacity_bytes)
            )
        self._deadlines: dict[bytes, float] = {}  # key -> when its TTL runs out
        self._deadline_heap: list[tuple[float, bytes]] = []  # lazy: an entry counts while it matches _deadlines
        self._pins: dict[bytes, float] = {}  # key -> when its pin runs out

    @property
    def tiers(self) -> list[Tier]:
        return [self.host] if self.ssd is None else [self.host, self.ssd]

    @property
    def num_blocks(self) -> int:
        return len(self._deadlines)

    def stats(self) -> StoreStats:
        return StoreStats(
            {t.name: TierStats(len(t), t.num_bytes, t.capacity_bytes) for t in self.tiers}, len(self._pins)
        )

    def ttl_s(self, traffic_class: str) -> float:
        return self.config.ttl_s.get(traffic_class, self.config.ttl_s[self.config.default_class])

    # -- start --------------------------------------------------------------------------------------------------
    def recover(self) -> list[StoreEvent]:
        """Take back what the SSD directory holds (at start): each file's deadline runs from its last write."""
        events: list[StoreEvent] = []
        if self.ssd is None:
            return events
        for meta in self.ssd.scan():
            self.ssd.policy.insert(meta.block_hash, meta.fragment.num_bytes(meta.layout.num_block_bytes))
            self._set_deadline(meta.block_hash, self.ssd.mtime(meta.block_hash) + self.ttl_s(meta.traffic_class))
            append_stored(events, meta, self.ssd.name)
        events += self.expire()
        return events

    def holdings(self) -> list[StoreEvent]:
        """Everything held, as the `BlocksStored` events that announce it (a resync of the global index)."""
        events: list[StoreEvent] = []
        for tier in self.tiers:
            keys = tier.keys()  # a tier's own iterator (not a dict's)
            for key in keys:
                meta = tier.meta(key)
                assert meta is not None
                append_stored(events, meta, tier.name)
        return events

    # -- writes -------------------------------------------------------------------------------------------------
    def put(self, blocks: Sequence[Block]) -> PutResult:
        """Store `blocks` in order, evicting by policy to make room; bad blocks are skipped with a reason."""
        result = PutResult()
        now = self.clock()
        capacity = max(t.capacity_bytes for t in self.tiers)
        for block, hint in zip(blocks, self._hints(blocks), strict=True):
            if block.block_hash in self._deadlines:
                self._refresh(block.block_hash, block.traffic_class, now)
                for tier in self._tiers_of(block.block_hash):
                    tier.policy.touch(block.block_hash)
                result.num_present += 1
                continue
            reason = rejection(block, capacity)
            if reason is not None:
                result.rejections.append(reason)
                continue
            block = block.with_checksum()
            stored = [self._add(tier, block, result.events, hint) for tier in self.tiers]
            if not any(stored):
                result.rejections.append(f"block {block.block_hash.hex()[:16]}: no room (every block is pinned)")
                continue
            self._set_deadline(block.block_hash, now + self.ttl_s(block.traffic_class))
            result.num_stored += 1
        return result

    def pin(self, keys: Sequence[bytes], model: str, ttl_s: float) -> int:
        """Pin the held ones of `keys` for `ttl_s` seconds (0: unpin them); returns how many."""
        now = self.clock()
        count = 0
        for key in keys:
            meta = self._meta(key)
            if meta is None or meta.layout.model != model:
                continue
            count += 1
            if ttl_s > 0:
                self._pins[key] = now + ttl_s
                for tier in self._tiers_of(key):
                    tier.policy.remove(key)
            elif key in self._pins:
                self._unpin(key, now)
        return count

    def expire(self) -> list[StoreEvent]:
        """Unpin pins past their time, then remove blocks past their deadline (reason "ttl")."""
        now = self.clock()
        for key in [k for k, until in self._pins.items() if until <= now]:
            self._unpin(key, now)
        events: list[StoreEvent] = []
        while self._deadline_heap and self._deadline_heap[0][0] <= now:
            deadline, key = heapq.heappop(self._deadline_heap)
            if self._deadlines.get(key) == deadline and key not in self._pins:
                self._remove(key, "ttl", events)
        return events

    # -- reads --------------------------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], model: str, skip_missing: bool = False) -> GetResult:
        """The held blocks of `keys` in order, stopping at the first one not held (or skipping it). A hit on SSD
        is promoted to host memory. Hits are used in reverse order, so a chain's first blocks are the most
        recent: a policy then gives up a chain's tail before its head (a tail without its head is useless)."""
        result = GetResult()
        now = self.clock()
        for key in keys:
            found = self._read(key, model, now, result.events)
            if found is None:
                if skip_missing:
                    continue
                break
            result.blocks.append(found)
        for block, _ in reversed(result.blocks):
            for tier in self._tiers_of(block.block_hash):
                tier.policy.touch(block.block_hash)
            self._refresh(block.block_hash, block.traffic_class, now)
        return result

    def lookup(self, keys: Sequence[bytes], model: str) -> int:
        """How many of `keys`, from the first, are held. A probe: recency is left alone."""
        indices = self.fragment_indices(keys, model)
        return next((n for n, index in enumerate(indices) if index < 0), len(indices))

    def fragment_indices(self, keys: Sequence[bytes], model: str) -> list[int]:
        """For each key, the fragment held (0 for a whole block), or -1."""
        now = self.clock()
        out = []
        for key in keys:
            meta = self._meta(key)
            live = meta is not None and meta.layout.model == model and self._is_live(key, now)
            out.append(meta.fragment.index if live and meta is not None else -1)
        return out

    def peek(self, key: bytes) -> Block | None:
        """The block with its data, from whichever tier holds it, changing nothing (for repair)."""
        for tier in self.tiers:
            block = tier.read(key)
            if block is not None:
                return block
        return None

    # -- internals ----------------------------------------------------------------------------------------------
    def _hints(self, blocks: Sequence[Block]) -> list[BlockHint]:
        """Each block's place in its chain run (consecutive blocks of the Put, each the parent of the next)."""
        runs: list[list[Block]] = []
        for block in blocks:
            if runs and runs[-1][-1].block_hash == block.parent_hash:
                runs[-1].append(block)
            else:
                runs.append([block])
        hints = []
        for run in runs:
            continues = run[0].parent_hash in self._deadlines
            hints += [BlockHint(i, len(run), continues, b.traffic_class) for i, b in enumerate(run)]
        return hints

    def _read(self, key: bytes, model: str, now: float, events: list[StoreEvent]) -> tuple[Block, str] | None:
        meta = self._meta(key)
        if meta is None or meta.layout.model != model:
            return None
        if not self._is_live(key, now):
            self._remove(key, "ttl", events)
            return None
        block = self.host.read(key)
        if block is not None:
            return block, self.host.name
        assert self.ssd is not None
        block = self.ssd.read(key)
        if block is None:  # its file is gone or corrupt: forget it
            self._remove(key, "corrupt", events)
            return None
        self._add(self.host, block, events)
        return block, self.ssd.name

    def _add(self, tier: Tier, block: Block, events: list[StoreEvent], hint: BlockHint = NO_HINT) -> bool:
        """Enter `block` into `tier`, evicting to make room; False when everything left there is pinned."""
        size = len(block.data)
        if size > tier.capacity_bytes:
            return False
        while tier.num_bytes + size > tier.capacity_bytes:
            victim = tier.policy.victim()
            if victim is None:
                return False
            meta = tier.drop(victim)
            assert meta is not None
            append_removed(events, victim, meta.layout.model, "capacity", tier.name)
            if not self._tiers_of(victim):
                self._forget(victim)
        tier.add(block)
        if block.block_hash not in self._pins:
            tier.policy.insert(block.block_hash, size, hint)
        append_stored(events, block, tier.name)
        return True

    def _remove(self, key: bytes, reason: str, events: list[StoreEvent]) -> None:
        for tier in self._tiers_of(key):
            tier.policy.remove(key)
            meta = tier.drop(key)
            assert meta is not None
            append_removed(events, key, meta.layout.model, reason, tier.name)
        self._forget(key)

    def _forget(self, key: bytes) -> None:
        self._deadlines.pop(key, None)
        self._pins.pop(key, None)

    def _unpin(self, key: bytes, now: float) -> None:
        del self._pins[key]
        for tier in self._tiers_of(key):
            meta = tier.meta(key)
            assert meta is not None
            tier.policy.insert(key, meta.fragment.num_bytes(meta.layout.num_block_bytes))
        meta = self._meta(key)
        assert meta is not None
        self._refresh(key, meta.traffic_class, now)  # the TTL starts over when the pin ends

    def _refresh(self, key: bytes, traffic_class: str, now: float) -> None:
        self._set_deadline(key, max(self._deadlines.get(key, 0.0), now + self.ttl_s(traffic_class)))

    def _set_deadline(self, key: bytes, deadline: float) -> None:
        if self._deadlines.get(key) == deadline:
            return
        self._deadlines[key] = deadline
        heapq.heappush(self._deadline_heap, (deadline, key))
        if len(self._deadline_heap) > 2 * len(self._deadlines) + 1024:  # drop stale entries now and then
            self._deadline_heap = [(d, k) for d, k in self._deadline_heap if self._deadlines.get(k) == d]
            heapq.heapify(self._deadline_heap)

    def _is_live(self, key: bytes, now: float) -> bool:
        return key in self._pins or self._deadlines.get(key, 0.0) > now

    def _meta(self, key: bytes) -> Block | None:
        for tier in self.tiers:
            meta = tier.meta(key)
            if meta is not None:
                return meta
        return None

    def _tiers_of(self, key: bytes) -> list[Tier]:
        return [tier for tier in self.tiers if key in tier]
