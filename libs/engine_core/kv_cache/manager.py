"""Which KV blocks each request holds, and the prefix-cache lookups and registrations on its behalf.

`KVCacheManager` is the only writer of the per-request block lists and of `Request.block_hashes`, and of which
request holds which state slot: a model that keeps a fixed-size state per sequence beside the blocks (DeepSeek-V4's
window and compressor tails: models.deepseek_v4.pools) gets `num_state_slots` of them, and a request holding blocks
holds one slot, taken with its first blocks and given back with them.
A block enters the prefix cache only once its KV has been computed (or imported), never when it is
merely allocated, so a cache hit always finds finished KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_core.kv_cache.block_hash import hash_token_blocks
from engine_core.kv_cache.block_pool import BlockPool, KVBlock
from engine_core.request import Request
from mesh.eviction.policies import make_policy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        eviction_policy: str = "lru",
        num_state_slots: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_state_slots = num_state_slots  # 0: the model keeps no state per sequence
        self._free_slots = list(range(num_state_slots))  # lowest first
        self._req_slots: dict[str, int] = {}
        self.enable_caching = enable_caching
        # `lru` keeps the pool's own free queue (least recently freed first); another name orders the free cached
        # blocks by that mesh.eviction policy, counted in blocks. An unknown name raises ValueError.
        eviction = None if eviction_policy == "lru" else make_policy(eviction_policy, num_blocks)
        self.pool = BlockPool(num_blocks, enable_caching, eviction)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of the request already in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Share of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    def state_slot(self, request_id: str) -> int:
        """The state slot the request holds; -1 for none (a model without per-sequence state)."""
        return self._req_slots.get(request_id, -1)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request, in full blocks, and its length in tokens.

        At least one token is always left to compute: the last prompt token's logits are needed.
        """
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the `computed_blocks` hit).

        Returns the newly allocated blocks, or None (changing nothing) when too few blocks are free, or when the
        request needs a state slot (it holds none yet) and none is free.
        """
        held = self._req_blocks.setdefault(request.request_id, [])
        assert not computed_blocks or not held, "cache hits are taken only by a request holding no blocks"
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_required = cdiv(num_tokens, self.block_size) - len(held) - len(computed_blocks)
        # hits that sit in the free queue stop being allocatable once we take them
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        needs_slot = self.num_state_slots > 0 and request.request_id not in self._req_slots
        if num_required > self.pool.num_free_blocks - num_free_hits or (needs_slot and not self._free_slots):
            if not held:
                del self._req_blocks[request.request_id]
            return None
        if needs_slot:
            self._req_slots[request.request_id] = self._free_slots.pop(0)
        self.pool.touch(computed_blocks)
        held.extend(computed_blocks)
        self._num_cached_blocks.setdefault(request.request_id, len(computed_blocks))
        new_blocks = self.pool.allocate(max(num_required, 0))
        held.extend(new_blocks)
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's full blocks whose KV is computed into the prefix cache."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        blocks = self._req_blocks[request.request_id]
        parent = request.block_hashes[start - 1] if start > 0 else request.cache_root
        tokens = request.all_token_ids[start * self.block_size : num_full * self.block_size]
        self.pool.cache_blocks(
            blocks[start:num_full], request.block_hashes[start:num_full], parent, tokens, self.block_size
        )
        self._num_cached_blocks[request.request_id] = num_full

    def skip_caching(self, request: Request, num_tokens: int) -> None:
        """The blocks holding the request's first `num_tokens` never enter the prefix cache: what they hold was not
        written here (a DeepSeek-V4 import carries the request's state, not its blocks' contents)."""
        self._num_cached_blocks[request.request_id] = cdiv(num_tokens, self.block_size)

    def free(self, request: Request) -> None:
        """Release every block the request holds, last block first (so tails are evicted before heads), and its
        state slot."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        slot = self._req_slots.pop(request.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._free_slots.sort()
        self.pool.free(reversed(blocks))

    def _update_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            request.block_hashes = hash_token_blocks(
                request.cache_root, request.all_token_ids, self.block_size, request.block_hashes, request.key_spans
            )
