"""The pool of KV blocks: reference counts, the free queue in eviction order, and the prefix-cache map.

Only `BlockPool` writes a block's `ref_cnt` and `block_hash`, the free queue and the cache map; everything
else reads them. A block is in exactly one of two states:
  - referenced (ref_cnt > 0): held by one or more requests, never evicted;
  - free (ref_cnt == 0): in the free queue. A free block that still has a hash is a cached block: a request
    can take it back (`touch`) until it is handed out again (`allocate`), which evicts it.
The free queue is ordered least recently freed first, so eviction is LRU by default; requests free their blocks
last-block-first, so the tail of a sequence is evicted before its (more shareable) head. Given an eviction policy
(`mesh.eviction`, the KV store's: `KVCacheManager` makes it from `EngineConfig.device_cache_policy`), the free
queue holds only uncached blocks, handed out first, and the free cached blocks are ordered by the policy: it gets
a block when its last reference goes (`insert`, then `touch` when the block was a cache hit meanwhile) and loses
it when a request takes it back, so it never names a block in use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine_core.kv_cache.block_hash import BlockHash
from engine_core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from mesh.eviction.policies import EvictionPolicy


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0  # written only by BlockPool
    block_hash: BlockHash | None = None  # set while the block is in the prefix cache; written only by BlockPool

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}" if self.block_hash else ""
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, eviction: EvictionPolicy | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._eviction = eviction  # None: the free queue's order (least recently freed first) for all free blocks
        self._evictable: dict[BlockHash, KVBlock] = {}  # with a policy: the free cached blocks, in its order
        self._hit_ids: set[int] = set()  # with a policy: blocks taken from the cache since their last free
        self._events: list[KVCacheEvent] = []
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out (free ones, cached or not)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue, next to be allocated first (for tests and debugging); with a policy, the uncached blocks
        in that order, then the cached ones in the order they were freed (the policy decides which goes first)."""
        return [*self._free, *(block.block_id for block in self._evictable.values())]

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._take_free(block)
            if self._eviction is not None:
                self._hit_ids.add(block.block_id)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Hand out `num_blocks` blocks from the head of the free queue, evicting cached ones."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self._next_free()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in order; unreferenced blocks join the queue's tail."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._put_free(block)

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Enter full blocks into the prefix cache under their keys.

        A key already cached by another block (two requests computed the same prefix at once) stays
        with that block; this one remains uncached and is reused as a plain block.
        """
        if not self.enable_caching:
            return
        stored: list[BlockHash] = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            assert block.block_hash is None, f"{block} is cached already"
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
        if stored:
            self._events.append(BlockStored(tuple(stored), parent_hash, tuple(token_ids), block_size))

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Take blocks out of the prefix cache: their KV is not what their key says (a load from elsewhere failed)."""
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash in self._evictable:
                self._take_free(block)
                self._evict(block)
                self._put_free(block)
            else:
                self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key. Refused (False) while any block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in list(self._evictable.values()):
            self._take_free(block)
            self._free[block.block_id] = block
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        self._events.append(BlockRemoved((block.block_hash,)))
        block.block_hash = None
        self.num_evictions += 1

    # -- the free blocks: one queue, or uncached blocks in a queue and cached ones under the eviction policy ---------
    def _put_free(self, block: KVBlock) -> None:
        if self._eviction is None or block.block_hash is None:
            self._free[block.block_id] = block
            self._hit_ids.discard(block.block_id)
            return
        self._evictable[block.block_hash] = block
        self._eviction.insert(block.block_hash, 1)
        if block.block_id in self._hit_ids:  # reused while held: the policy counts it as a hit
            self._hit_ids.discard(block.block_id)
            self._eviction.touch(block.block_hash)

    def _take_free(self, block: KVBlock) -> None:
        if block.block_id in self._free:
            del self._free[block.block_id]
            return
        assert self._eviction is not None and block.block_hash is not None, f"{block} is not free"
        del self._evictable[block.block_hash]
        self._eviction.remove(block.block_hash)

    def _next_free(self) -> KVBlock:
        """The block `allocate` hands out next: an uncached one while any is free, else the policy's victim."""
        if self._free:
            return self._free.popitem(last=False)[1]
        assert self._eviction is not None
        key = self._eviction.victim()
        assert key is not None, "the eviction policy lost a free block"
        return self._evictable.pop(key)
