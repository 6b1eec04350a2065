"""KVIndex: which block hashes each prefill worker holds, followed from its KV event batches.

Written only by the balancer's KV-event subscription (`apply_*`, `check_seq`) and its registry's leave callback
(`drop`); the Router only reads it. The index may lag a worker's cache by a batch or miss one (a seq gap): that
costs at most a cache miss, never a failed request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[bytes]] = {}
        self._last_seq: dict[str, int] = {}

    def check_seq(self, worker_id: str, seq: int) -> int:
        """Record batch `seq` of `worker_id`; returns how many batches were skipped before it (0 when in order,
        and for a worker's first batch seen). A seq that does not increase means the worker's stream started over
        (a new process under the same id, with an empty cache): what was known of it is forgotten."""
        last = self._last_seq.get(worker_id)
        self._last_seq[worker_id] = seq
        if last is None:
            return 0
        if seq <= last:
            self._blocks.pop(worker_id, None)
            return 0
        return seq - last - 1

    def add(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        self._blocks.setdefault(worker_id, set()).update(block_hashes)

    def remove(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        held = self._blocks.get(worker_id)
        if held is not None:
            held.difference_update(block_hashes)

    def clear(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)

    def drop(self, worker_id: str) -> None:
        """The worker left its pool: forget its blocks and its event numbering."""
        self._blocks.pop(worker_id, None)
        self._last_seq.pop(worker_id, None)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def num_leading_hits(self, worker_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, the worker holds (a prefix is usable only up to a gap)."""
        held = self._blocks.get(worker_id)
        if not held:
            return 0
        num_hits = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            num_hits += 1
        return num_hits
