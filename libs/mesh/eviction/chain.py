"""ChainPolicy (`chain`): LRU in which a chain's deeper blocks are older than the blocks they extend.

A block is worth something only while every block before it in its chain is held: a request's hit ends at its first
missing block. The store reads a hit prefix last block first (`BlockStore.get`), so under LRU the prefix's head is
its most recent block and goes last. But a Put writes the rest of the chain head first, so under LRU the new blocks
are newer than the prefix they extend, and the prefix's deepest block goes before any of them: from then on every
block the Put wrote is held and useless. Here a Put's run (`BlockHint`: its place in the run, the run's length,
whether it extends a prefix this store holds) sits just below the deepest block of the prefix it extends, deeper
blocks older: a chain is given up from its end.

Recency is a tick counted per touch; a run that extends a prefix takes the tick of the first touch of the latest
streak of touches (the prefix's deepest block, as `get` touches it first), any other run a new tick. A run's block
at place p of n gets that tick minus (p + 1) / (n + 2): below the prefix, above everything older. A device cache
gives no hints (each block a run of one, extending nothing), so there it orders exactly as LRU.

Work per operation: one heap push (O(log n)); `victim` pops stale entries lazily. Memory per held block, keys not
counted: a live heap entry and its dict entry (`AgingHeap`), measured in docs/kvcache.md.
"""

from __future__ import annotations

from mesh.eviction.aging import AgingHeap
from mesh.eviction.hint import NO_HINT, BlockHint


class ChainPolicy:
    def __init__(self, capacity_bytes: int = 0) -> None:
        self._heap = AgingHeap()  # held keys by priority (a tick), lowest first
        self._tick = 0
        self._streak_start: int | None = None  # the tick of the first touch since the last insert
        self._run = NO_HINT  # the hint of the last insert: a later place in the same run shares its base
        self._base = 0  # the tick the current run sits just below

    def insert(self, key: bytes, size: int, hint: BlockHint = NO_HINT) -> None:
        is_same_run = hint.position > self._run.position and hint.run_blocks == self._run.run_blocks
        if not is_same_run:
            if hint.continues and self._streak_start is not None:
                self._base = self._streak_start
            else:
                self._tick += 1
                self._base = self._tick
        self._run = hint
        self._streak_start = None
        self._heap.push(key, self._base - (hint.position + 1) / (hint.run_blocks + 2))

    def touch(self, key: bytes) -> None:
        if key not in self._heap:
            return
        self._tick += 1
        if self._streak_start is None:
            self._streak_start = self._tick
        self._heap.push(key, self._tick)

    def remove(self, key: bytes) -> None:
        self._heap.discard(key)

    def victim(self) -> bytes | None:
        return self._heap.pop()

    def __len__(self) -> int:
        return len(self._heap)
