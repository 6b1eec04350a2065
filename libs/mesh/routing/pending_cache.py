"""PendingCache: the blocks a prefill worker will hold once the requests sent to it are computed, before its KV
events say so (optimistic cache accounting, as the LoadView's is for load). Without it, a conversation's next
turn that arrives while the previous one is still queued sees no cache anywhere, and a router that follows only
the index sends it elsewhere to be computed from scratch.

A block counts as pending until the assignment's predicted prefill end plus `grace_s` (by then the KV events
have normally reached the index, or the prediction was wrong and the index is the better guide).
One writer: the LoadView that owns it (`add`); `num_leading` reads and drops what expired.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence


class PendingCache:
    def __init__(self, grace_s: float = 1.0) -> None:
        self.grace_s = grace_s
        self._expiry: dict[str, dict[bytes, float]] = {}  # worker -> key -> when it stops counting
        self._order: dict[str, deque[tuple[float, tuple[bytes, ...]]]] = {}  # worker -> (expiry, keys), as added

    def add(self, worker_id: str, block_hashes: tuple[bytes, ...], done_s: float) -> None:
        if not block_hashes:
            return
        expiry = done_s + self.grace_s
        held = self._expiry.setdefault(worker_id, {})
        for key in block_hashes:
            held[key] = max(held.get(key, expiry), expiry)
        self._order.setdefault(worker_id, deque()).append((expiry, block_hashes))

    def forget(self, worker_id: str) -> None:
        self._expiry.pop(worker_id, None)
        self._order.pop(worker_id, None)

    def num_leading(
        self,
        worker_id: str,
        block_hashes: Sequence[bytes],
        start: int,
        now_s: float,
        is_indexed: Callable[[bytes], bool],
    ) -> int:
        """From block `start` on (the first `start` are indexed on the worker), how many more blocks the worker
        holds or will hold, counting pending and indexed ones alike."""
        self._expire(worker_id, now_s)
        held = self._expiry.get(worker_id)
        if not held:
            return start
        n = start
        while n < len(block_hashes) and (block_hashes[n] in held or is_indexed(block_hashes[n])):
            n += 1
        return n

    def _expire(self, worker_id: str, now_s: float) -> None:
        order = self._order.get(worker_id)
        held = self._expiry.get(worker_id)
        while order and held is not None and order[0][0] < now_s:
            _, keys = order.popleft()
            for key in keys:
                if held.get(key, now_s) < now_s:
                    del held[key]
