"""What the prefix cache reports as it changes, for a global index to follow (the mesh publishes these)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.kv_cache.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """A chain of full blocks entered the cache; `parent_hash` is the key of the block before the first."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]  # the blocks' tokens, concatenated
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the cache (evicted to make room, or cleared)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
