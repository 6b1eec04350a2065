"""FrequencySketch: about how often each key was seen lately, in a fixed few bytes per tracked key (TinyLFU's
count-min sketch, Einziger et al., ACM ToS 2017; Caffeine's admission filter).

Four rows of one-byte counters capped at 15, each key counted in one counter per row (double hashing of its
BLAKE2b digest, so estimates are the same in every process); a key's estimate is the least of its four. Every
`sample_size` increments all counters are halved, so the sketch forgets old popularity and follows the trace.
The width grows (doubling, counts dropped) when the caller tracks more keys than it was sized for.
It remembers keys the cache no longer holds: that is the point (a prefix that comes back after its eviction is
known to come back).
"""

from __future__ import annotations

from hashlib import blake2b

NUM_ROWS = 4
MAX_COUNT = 15
_HALVE = bytes(i >> 1 for i in range(256))


class FrequencySketch:
    def __init__(self, num_keys: int = 1024) -> None:
        self._width = 1
        self._counts = bytearray()  # NUM_ROWS rows of _width counters
        self._sample_size = 0  # increments between halvings
        self._num_increments = 0
        self._resize(num_keys)

    @property
    def num_bytes(self) -> int:
        return len(self._counts)

    def ensure_capacity(self, num_keys: int) -> None:
        """Grow (and start counting afresh) once the caller holds more keys than the sketch was sized for."""
        if num_keys > self._width:
            self._resize(num_keys)

    def increment(self, key: bytes) -> None:
        counts = self._counts
        for index in self._indices(key):
            if counts[index] < MAX_COUNT:
                counts[index] += 1
        self._num_increments += 1
        if self._num_increments >= self._sample_size:
            self._counts = self._counts.translate(_HALVE)
            self._num_increments //= 2

    def frequency(self, key: bytes) -> int:
        """How many times `key` was counted lately (never less than the truth since the last halving)."""
        counts = self._counts
        return min(counts[index] for index in self._indices(key))

    def _indices(self, key: bytes) -> list[int]:
        digest = int.from_bytes(blake2b(key, digest_size=8).digest(), "little")
        first, step = digest & 0xFFFFFFFF, (digest >> 32) | 1
        mask = self._width - 1
        return [row * self._width + ((first + row * step) & mask) for row in range(NUM_ROWS)]

    def _resize(self, num_keys: int) -> None:
        while self._width < num_keys:
            self._width *= 2
        self._counts = bytearray(NUM_ROWS * self._width)
        self._sample_size = 10 * self._width  # as Caffeine: a reset every 10 increments per counter of a row
        self._num_increments = 0
