"""The priority queue behind the LFU-with-dynamic-aging policies (`lfuda`, `reuse` behind its filter) and `chain`."""

from __future__ import annotations

import heapq
import itertools


class AgingHeap:
    """Keys by priority, lowest first, ties oldest first: a min-heap with lazy deletion (a key pushed again or
    discarded leaves a stale entry, skipped when popped, and dropped now and then). `floor` is the priority of the
    last key popped: a policy gives new keys priorities above it, so they outrank every key older than it."""

    def __init__(self) -> None:
        self.floor: float = 0
        self._entry: dict[bytes, tuple[float, int]] = {}  # key -> its live heap entry's (priority, order)
        self._heap: list[tuple[float, int, bytes]] = []  # (priority, order, key)
        self._order = itertools.count()

    def push(self, key: bytes, priority: float) -> None:
        """Add `key`, or move it, to `priority`."""
        entry = (priority, next(self._order))
        self._entry[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._entry) + 1024:  # drop stale entries now and then
            self._heap = [(p, o, k) for p, o, k in self._heap if self._entry.get(k) == (p, o)]
            heapq.heapify(self._heap)

    def discard(self, key: bytes) -> None:
        self._entry.pop(key, None)

    def pop(self) -> bytes | None:
        """Remove and return the lowest key (None when empty), raising the floor to its priority."""
        while self._heap:
            priority, order, key = heapq.heappop(self._heap)
            if self._entry.get(key) == (priority, order):
                self.floor = priority
                del self._entry[key]
                return key
        return None

    def __contains__(self, key: bytes) -> bool:
        return key in self._entry

    def __len__(self) -> int:
        return len(self._entry)
