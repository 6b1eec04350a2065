"""ReusePolicy (`reuse`): LFU with dynamic aging (as `lfuda`) behind an admission filter that predicts reuse.

Admission. A block seen for the first time falls in a class made of features the store already sees
(`BlockHint`): the length of the chain run its Put carried (a whole document's prompt vs one turn's new tail),
whether that run extended a prefix the store held, and its traffic class. The policy learns online, per class,
the share of first-seen blocks that were asked for again within a window of recent first sightings (about
`GHOST_FACTOR` times what the tier holds). A block whose class is reused less than `ADMIT_RATIO` times the
average goes to a small window (`WINDOW_FRACTION` of the bytes, W-TinyLFU's) that is evicted first, oldest first,
and a hit there admits it: a one-off prompt passes through the window instead of flushing the cache. Whether a
key was seen before, held or not, comes from a `FrequencySketch` (TinyLFU's count-min sketch): a prefix that
comes back after its eviction is always admitted.

Eviction. An admitted block's priority is the floor plus its hits while held plus one, capped at `MAX_FREQ`; the
lowest goes first, the oldest among equals, and the floor becomes each victim's priority (GreedyDual aging), so
recency still ages frequency out.

Both halves can be switched off (`admission`, `max_freq`: 1 orders as LRU does); `reuse` as `make_policy` builds it
(`duel.py`) switches them by what miniature caches of each choice would have hit. `admit` is the filter alone in
front of LRU's order, holding back only classes reused at less than `ADMIT_LRU_RATIO` times the average: it gains
less where one-off prompts flush the cache, and with the replay's full-block rule falls below LRU only on the
conversation trace at 15% and 35% of the unique blocks, by at most 0.5% (`kvmesh bench kvcache --sweep`,
docs/kvcache.md).

Work per operation: a heap push (O(log n)), four sketch counters and a dict update; `victim` pops stale heap
entries lazily. Memory per held block, keys not counted: 64 sketch bytes (`SKETCH_WIDTH` counters in each of 4
rows, the width rounded up to a power of two), dict and heap entries and up to `GHOST_FACTOR` first-sighting
records: 325 B in all as tracemalloc measures 50,000 blocks (`lfuda` 311 B, `lru` 105 B); the class table is a
few dozen entries whatever the size.
"""

from __future__ import annotations

from collections import OrderedDict

from mesh.eviction.aging import AgingHeap
from mesh.eviction.hint import NO_HINT, BlockHint
from mesh.eviction.sketch import FrequencySketch

MAX_FREQ = 4
GHOST_FACTOR = 2  # first sightings remembered, as a multiple of the blocks held
ADMIT_RATIO = 0.9  # admit a first-seen block when its class is reused at least this times the average
ADMIT_LRU_RATIO = 0.6  # `admit`'s: hold back only the clearly worse classes (0.7 lost to LRU on the conversation trace)
WINDOW_FRACTION = 0.01  # bytes for blocks not admitted (W-TinyLFU's window): a hit there admits them
SKETCH_WIDTH = 16  # sketch counters per row per held block: few false "seen before" (4 rows: 64 bytes a block)
PRIOR_BLOCKS = 8.0  # a class starts as if this many of its blocks had been reused at the average rate
DECAY_EVERY = 100_000  # first sightings between halvings of the class counts, to follow a changing workload

Class = tuple[int, bool, str]


def run_bucket(num_blocks: int) -> int:
    """0, 1, 2, 3... for runs of 1, 2-3, 4-7, 8-15... blocks (at most 8: 256 and more)."""
    return min(max(num_blocks, 1).bit_length() - 1, 8)


def class_of(hint: BlockHint) -> Class:
    return (run_bucket(hint.run_blocks), hint.continues, hint.traffic_class)


class ReusePolicy:
    def __init__(
        self,
        capacity_bytes: int = 0,
        admission: bool = True,
        max_freq: int = MAX_FREQ,
        admit_ratio: float = ADMIT_RATIO,
    ) -> None:
        self.admission = admission  # filter first-seen blocks by class (False: admit every block); see duel.py
        self.max_freq = max_freq  # the priority cap: 1 orders as LRU does, MAX_FREQ as lfuda; see duel.py
        self.admit_ratio = admit_ratio  # a class is admitted when reused at least this times the average
        self.window_target_bytes = int(capacity_bytes * WINDOW_FRACTION)
        self._window: OrderedDict[bytes, int] = OrderedDict()  # not admitted: key -> size, oldest first
        self._window_bytes = 0
        self._heap = AgingHeap()  # the admitted keys, in lfuda's order
        self._hits: dict[bytes, int] = {}  # key -> 1 + hits while held, capped at max_freq
        self._sketch = FrequencySketch()
        self._first_seen: OrderedDict[bytes, Class] = OrderedDict()  # recent first sightings, oldest first
        self._num_seen: dict[Class, float] = {}  # class -> first sightings
        self._num_reused: dict[Class, float] = {}  # class -> of those, asked for again while remembered
        self._num_sightings = 0

    # -- the EvictionPolicy contract ----------------------------------------------------------------------------
    def insert(self, key: bytes, size: int, hint: BlockHint = NO_HINT) -> None:
        self._sketch.ensure_capacity(SKETCH_WIDTH * (len(self) + 1))
        is_known = self._sketch.frequency(key) > 0
        self._seen(key)
        self._hits[key] = 1
        klass = class_of(hint)
        is_admitted = is_known or not self.admission or self.admits(klass)
        if not is_known:
            self._first_sighting(key, klass)
        if is_admitted:
            self._heap.push(key, self._heap.floor + 1)
        else:
            self._window[key] = size
            self._window_bytes += size

    def touch(self, key: bytes) -> None:
        size = self._window.pop(key, None)
        if size is not None:  # a hit in the window: admitted after all
            self._window_bytes -= size
            self._seen(key)
            self._hits[key] = min(2, self.max_freq)
            self._heap.push(key, self._heap.floor + self._hits[key])
            return
        if key in self._hits:
            self._seen(key)
            self._hits[key] = min(self._hits[key] + 1, self.max_freq)
            self._heap.push(key, self._heap.floor + self._hits[key])

    def remove(self, key: bytes) -> None:
        self._hits.pop(key, None)
        self._heap.discard(key)
        size = self._window.pop(key, None)
        if size is not None:
            self._window_bytes -= size

    def victim(self) -> bytes | None:
        if self._window and (self._window_bytes > self.window_target_bytes or not self._heap):
            key, size = self._window.popitem(last=False)
            self._window_bytes -= size
            self._hits.pop(key, None)
            return key
        admitted = self._heap.pop()
        if admitted is not None:
            del self._hits[admitted]
        return admitted

    def __len__(self) -> int:
        return len(self._heap) + len(self._window)

    # -- prediction ---------------------------------------------------------------------------------------------
    def reuse_rate(self, klass: Class) -> float:
        """The learned share of first-seen blocks of `klass` that were asked for again soon."""
        average = self._average_rate()
        seen, reused = self._num_seen.get(klass, 0.0), self._num_reused.get(klass, 0.0)
        return (reused + average * PRIOR_BLOCKS) / (seen + PRIOR_BLOCKS)

    def admits(self, klass: Class) -> bool:
        return self.reuse_rate(klass) >= self.admit_ratio * self._average_rate()

    def _average_rate(self) -> float:
        seen = sum(self._num_seen.values())
        return (sum(self._num_reused.values()) + 0.5) / (seen + 1.0)

    def _seen(self, key: bytes) -> None:
        """Count a sighting; a key first seen recently credits its class with a reuse."""
        self._sketch.increment(key)
        klass = self._first_seen.pop(key, None)
        if klass is not None:
            self._num_reused[klass] = self._num_reused.get(klass, 0.0) + 1

    def _first_sighting(self, key: bytes, klass: Class) -> None:
        self._first_seen[key] = klass
        self._num_seen[klass] = self._num_seen.get(klass, 0.0) + 1
        while len(self._first_seen) > GHOST_FACTOR * max(len(self._heap), 1):
            self._first_seen.popitem(last=False)
        self._num_sightings += 1
        if self._num_sightings % DECAY_EVERY == 0:
            self._num_seen = {c: n / 2 for c, n in self._num_seen.items()}
            self._num_reused = {c: n / 2 for c, n in self._num_reused.items()}
