"""DuelingReusePolicy (`reuse` as `make_policy` builds it): the `reuse` policy with its two choices, whether to
filter first-seen blocks and whether to order by frequency, set by what each choice would have hit lately.

Which choice wins depends on the workload: on a trace whose prefixes come back by recency (Mooncake's
conversation trace) holding back any class of first-seen blocks costs more hits than the room it frees, and LRU's
order is as good as any; where one-off prompts flush the cache (the synthetic and generated traces) the filter and
frequency win. So the policy runs one miniature cache per choice (`CONFIGS`: plain LRU, lfuda, the filter in front
of lfuda's order) on a hash-chosen sample of the keys, each with the same share of the bytes (spatial sampling,
Waldspurger et al.: SHARDS, FAST'15, and miniature simulations, ATC'17: a sampled cache has about the full one's
hit rate), and follows the one that hit most lately (hits halved every `HALVE_EVERY` shadow capacities of sampled
accesses), moving only when it beats the current one by `MARGIN`. A switch changes only what happens next: blocks
already held keep their priorities and the learned reuse rates carry over, so there is no flush.

Cost: the sample is 1/2^s of the keys, the largest share that still leaves each miniature cache `SHADOW_BLOCKS`
blocks (all keys below that, 1/64 at most), so three shadows cost at most three times the policy's own work per
sampled key (at most 3/64 in a large tier) and as much memory per sampled block; plus one BLAKE2b of each key.
"""

from __future__ import annotations

from collections import OrderedDict
from hashlib import blake2b

from mesh.eviction.hint import NO_HINT, BlockHint
from mesh.eviction.reuse import MAX_FREQ, ReusePolicy

CONFIGS: tuple[tuple[bool, int], ...] = ((False, 1), (False, MAX_FREQ), (True, MAX_FREQ))  # (admission, max_freq)
CONFIG_NAMES = ("lru", "lfuda", "filter+lfuda")
START = 0  # follow plain LRU until a shadow has shown better
SHADOW_BLOCKS = 2048  # blocks each miniature cache should hold at least
MAX_SAMPLE_SHIFT = 6  # sample at least 1/64 of the keys
HALVE_EVERY = 4  # shadow capacities of sampled accesses between halvings of the shadows' hits
DECIDE_EVERY = 64  # sampled accesses between choices
MARGIN = 0.05  # a shadow must hit this much more than the followed one to be followed instead (0.01 fell below
# LRU on the synthetic trace at 50% and 75%: late switches to the filter; docs/kvcache.md)


class Shadow:
    """A miniature cache of keys only, under one fixed configuration: what it would have hit."""

    def __init__(self, capacity_bytes: int, admission: bool, max_freq: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = ReusePolicy(capacity_bytes, admission=admission, max_freq=max_freq)
        self.num_hits = 0.0  # decayed by the owner
        self._sizes: dict[bytes, int] = {}  # held key -> size
        self._num_bytes = 0

    def access(self, key: bytes, size: int, hint: BlockHint) -> None:
        if key in self._sizes:
            self.num_hits += 1
            self.policy.touch(key)
            return
        self.policy.insert(key, size, hint)
        self._sizes[key] = size
        self._num_bytes += size
        while self._num_bytes > self.capacity_bytes:
            victim = self.policy.victim()
            if victim is None:
                break
            self._num_bytes -= self._sizes.pop(victim)

    def remove(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._num_bytes -= size
            self.policy.remove(key)


class DuelingReusePolicy(ReusePolicy):
    """A ReusePolicy whose `admission` and `max_freq` follow the best of its shadows. The shadows, the sample and
    the choice are written only here; the tier sees the EvictionPolicy contract."""

    def __init__(self, capacity_bytes: int = 0) -> None:
        admission, max_freq = CONFIGS[START]
        super().__init__(capacity_bytes, admission=admission, max_freq=max_freq)
        self.capacity_bytes = capacity_bytes
        self.followed = START  # index into CONFIGS
        self.shadows: list[Shadow] = []  # one per CONFIGS entry, made at the first insert (sizes known then)
        self._sample_mask = 0
        self._hints: OrderedDict[bytes, tuple[int, BlockHint]] = OrderedDict()  # sampled key -> size, hint at put
        self._last_size = 0
        self._num_sampled = 0
        self._halve_every = 0

    def insert(self, key: bytes, size: int, hint: BlockHint = NO_HINT) -> None:
        if not self.shadows and self.capacity_bytes > 0:
            self._start(size)
        if self.shadows and self._is_sampled(key):
            self._hints[key] = (size, hint)
            self._hints.move_to_end(key)
            while len(self._hints) > 4 * self._halve_every:
                self._hints.popitem(last=False)
            self._access(key, size, hint)
        self._last_size = size
        super().insert(key, size, hint)

    def touch(self, key: bytes) -> None:
        if self.shadows and self._is_sampled(key):
            size, hint = self._hints.get(key) or (self._last_size, NO_HINT)  # as put last, when remembered
            self._access(key, size, hint)
        super().touch(key)

    def remove(self, key: bytes) -> None:
        if self.shadows and self._is_sampled(key):
            for shadow in self.shadows:
                shadow.remove(key)
        super().remove(key)

    def _start(self, size: int) -> None:
        num_blocks = self.capacity_bytes // max(size, 1)
        shift = 0
        while shift < MAX_SAMPLE_SHIFT and num_blocks >> (shift + 1) >= SHADOW_BLOCKS:
            shift += 1
        self._sample_mask = (1 << shift) - 1
        shadow_bytes = max(self.capacity_bytes >> shift, size)
        self._halve_every = HALVE_EVERY * max(num_blocks >> shift, 1)
        self.shadows = [Shadow(shadow_bytes, admission, max_freq) for admission, max_freq in CONFIGS]

    def _is_sampled(self, key: bytes) -> bool:
        if not self._sample_mask:
            return True
        return int.from_bytes(blake2b(key, digest_size=4).digest(), "little") & self._sample_mask == 0

    def _access(self, key: bytes, size: int, hint: BlockHint) -> None:
        for shadow in self.shadows:
            shadow.access(key, size, hint)
        self._num_sampled += 1
        if self._num_sampled % self._halve_every == 0:
            for shadow in self.shadows:
                shadow.num_hits /= 2
        if self._num_sampled % DECIDE_EVERY == 0:
            self._choose()

    def _choose(self) -> None:
        best = max(range(len(CONFIGS)), key=lambda i: self.shadows[i].num_hits)
        if self.shadows[best].num_hits > self.shadows[self.followed].num_hits * (1 + MARGIN):
            self.followed = best
            self.admission, self.max_freq = CONFIGS[best]
