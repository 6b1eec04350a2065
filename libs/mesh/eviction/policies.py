"""Eviction policies: which block a cache gives up when it needs room. Pluggable by name (`make_policy`): the KV
store's tiers (KVMESH_EVICTION_POLICY) and the workers' device prefix caches (KVMESH_DEVICE_CACHE_POLICY).

A policy tracks keys and their sizes, never the data. The cache that owns it is its only writer: `insert` a new
key, `touch` a hit, `remove` a key that left for another reason (TTL, a pin, a device block taken by a request),
`victim` to pop the next key to evict. Pinned keys are simply not in the policy while pinned, so they are never
victims.

- `lru`: least recently used first.
- `s3fifo`: S3-FIFO (Yang et al., SOSP'23): a small FIFO (10% of the bytes) that new keys enter, a main FIFO
  with a 2-bit access counter (a key seen again is re-inserted instead of evicted), and a ghost FIFO of keys
  recently evicted from the small queue (a ghost that comes back goes straight to main). One-hit wonders leave
  quickly through the small queue; reused prefixes settle in main. Chosen by measurement on the Mooncake traces
  (`kvmesh bench kvcache`, see the README's KV cache section).
- `lfuda`: LFU with dynamic aging (GreedyDual-Size-Frequency where recomputing a block costs in proportion to its
  size): a key's priority is the priority of the last victim plus its hit count (capped at 4); the lowest
  priority goes first, the oldest among equals. Recency ages frequency out, so hot shared prefixes stay while
  a conversation's latest turn is still kept long enough to be reused. The default until issue 22: with the
  replay's full-block rule it falls below LRU on the conversation trace from 35% of the unique blocks on, and on
  the synthetic trace at 5% and 10%.
- `reuse`: an admission filter that predicts reuse in front of lfuda's order (`reuse.py`), whether to filter and
  whether to order by frequency chosen by miniature caches that replay a sample of the keys under each choice
  (`duel.py`). The default: at or above LRU on every trace and capacity of `kvmesh bench kvcache --sweep`
  (docs/kvcache.md), the project's rule for a default, and of the two policies that are (with `chain`), the one
  that gains most where the cache is scarce.
- `admit`: the same filter in front of LRU's order, holding back only classes reused at less than 0.6 times the
  average (`reuse.ADMIT_LRU_RATIO`), so it gives up little where every class comes back alike. At or above LRU on
  every trace and capacity of `kvmesh bench kvcache --sweep` until the replay kept full blocks only; now below it
  on the conversation trace at 15% and 35% (docs/kvcache.md).
- `chain`: LRU in which a Put's new blocks sit just below the prefix they extend, deeper blocks older, so a chain
  is given up from its end (`chain.py`); without hints (a device cache) it is LRU. At or above LRU on every trace
  and capacity of `kvmesh bench kvcache --sweep`, by at most 2.1% (docs/kvcache.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from mesh.eviction.aging import AgingHeap
from mesh.eviction.chain import ChainPolicy
from mesh.eviction.duel import DuelingReusePolicy
from mesh.eviction.hint import NO_HINT, BlockHint
from mesh.eviction.reuse import ADMIT_LRU_RATIO, ReusePolicy

POLICIES = ("lru", "s3fifo", "lfuda", "reuse", "admit", "chain")
DEFAULT_POLICY = "reuse"


class EvictionPolicy(Protocol):
    def insert(self, key: bytes, size: int, hint: BlockHint = NO_HINT) -> None: ...

    def touch(self, key: bytes) -> None: ...

    def remove(self, key: bytes) -> None: ...

    def victim(self) -> bytes | None:
        """Pop the next key to evict (None when the policy holds nothing)."""
        ...

    def __len__(self) -> int: ...


class LRUPolicy:
    def __init__(self, capacity_bytes: int = 0) -> None:
        self._keys: OrderedDict[bytes, int] = OrderedDict()  # least recently used first

    def insert(self, key: bytes, size: int, hint: BlockHint = NO_HINT) -> None:
        self._keys[key] = size
        self._keys.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def victim(self) -> bytes | None:
        if not self._keys:
            return None
        return self._keys.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._keys)


class S3FIFOPolicy:
    """Small, main and ghost FIFOs. `freq` counts hits since entering a queue, capped at 3."""

    MAX_FREQ = 3

    def __init__(self, capacity_bytes: int, small_fraction: float = 0.1, move_threshold: int = 1) -> None:
        assert capacity_bytes > 0 and 0 < small_fraction < 1
        self.small_target_bytes = int(capacity_bytes * small_fraction)
        self.move_threshold = move_threshold  # hits in the small queue that earn a place in main
        self._small: OrderedDict[bytes, int] = OrderedDict()  # key -> size, oldest first
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()  # keys only; as many as main holds
        self._freq: dict[bytes, int] = {}
        self._small_bytes = 0

    def insert(self, key: bytes, size: int, hint: BlockHint = NO_HINT) -> None:
        self.remove(key)
        self._freq[key] = 0
        if self._ghost.pop(key, 0) is None:  # seen recently: it earned main
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_bytes += size

    def touch(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: bytes) -> None:
        if self._freq.pop(key, None) is None:
            return
        size = self._small.pop(key, None)
        if size is not None:
            self._small_bytes -= size
        else:
            self._main.pop(key, None)

    def victim(self) -> bytes | None:
        while self._small or self._main:
            if self._small and (self._small_bytes >= self.small_target_bytes or not self._main):
                key = self._evict_small()
            else:
                key = self._evict_main()
            if key is not None:
                return key
        return None

    def _evict_small(self) -> bytes | None:
        key, size = self._small.popitem(last=False)
        self._small_bytes -= size
        if self._freq[key] >= self.move_threshold:
            self._freq[key] = 0
            self._main[key] = size
            return None
        del self._freq[key]
        self._ghost[key] = None
        while len(self._ghost) > max(len(self._main), 1):
            self._ghost.popitem(last=False)
        return key

    def _evict_main(self) -> bytes | None:
        key, size = self._main.popitem(last=False)
        if self._freq[key] > 0:
            self._freq[key] -= 1
            self._main[key] = size  # a second chance at the tail
            return None
        del self._freq[key]
        return key

    def __len__(self) -> int:
        return len(self._freq)


class LFUDAPolicy:
    """Priority = aging floor + min(hits, MAX_FREQ), kept in an AgingHeap."""

    MAX_FREQ = 4

    def __init__(self, capacity_bytes: int = 0) -> None:
        self._heap = AgingHeap()
        self._freq: dict[bytes, int] = {}

    def insert(self, key: bytes, size: int, hint: BlockHint = NO_HINT) -> None:
        self._freq[key] = 1
        self._push(key)

    def touch(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)
            self._push(key)

    def remove(self, key: bytes) -> None:
        self._freq.pop(key, None)
        self._heap.discard(key)

    def victim(self) -> bytes | None:
        key = self._heap.pop()
        if key is not None:
            del self._freq[key]
        return key

    def _push(self, key: bytes) -> None:
        self._heap.push(key, self._heap.floor + self._freq[key])

    def __len__(self) -> int:
        return len(self._heap)


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    if name == "lfuda":
        return LFUDAPolicy(capacity_bytes)
    if name == "lru":
        return LRUPolicy(capacity_bytes)
    if name == "s3fifo":
        return S3FIFOPolicy(capacity_bytes)
    if name == "reuse":
        return DuelingReusePolicy(capacity_bytes)
    if name == "admit":
        return ReusePolicy(capacity_bytes, admission=True, max_freq=1, admit_ratio=ADMIT_LRU_RATIO)
    if name == "chain":
        return ChainPolicy(capacity_bytes)
    raise ValueError(f"unknown eviction policy {name!r}: expected one of {', '.join(POLICIES)}")
