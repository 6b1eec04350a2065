"""HostBlockStore: KV blocks by key in host memory, within a byte capacity, least recently used evicted first.

The store is the only writer of its blocks; the KV cache servicer is its only caller. Each change is returned as
events (`BlocksStored`, `BlocksRemoved`) for the servicer to publish, so a global index can follow the store.
Block data is opaque here: the store checks its size against the layout and hands it back unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class BlockError(ValueError):
    """A block the store does not take (the servicer rejects it with INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class KVLayout:
    """How to read a block's bytes: the wire's KVLayout. The engine's twin (engine_core.kv_transfer.KVLayout) is not
    imported so that a store node needs no torch."""

    model: str
    dtype: str  # float32 | bfloat16 | float16
    block_size: int  # tokens per block
    num_layers: int
    layer_shape: tuple[int, ...]  # one layer's chunk for ONE block
    block_axis: int

    @property
    def num_block_bytes(self) -> int:
        """Bytes of one block across every layer (for a known dtype)."""
        numel = 1
        for size in self.layer_shape:
            numel *= size
        return self.num_layers * numel * _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Block:
    block_hash: bytes
    parent_hash: bytes  # the key of the block before it in its chain (the chain's root for a first block)
    layout: KVLayout
    data: bytes  # every layer's chunk for this block, layer 0 first


@dataclass
class BlocksStored:
    """A chain of blocks entered the store: `block_hashes[0]`'s parent is `parent_hash`."""

    block_hashes: list[bytes]
    parent_hash: bytes
    block_size: int
    model: str


@dataclass
class BlocksRemoved:
    block_hashes: list[bytes]
    model: str
    reason: str  # capacity


StoreEvent = BlocksStored | BlocksRemoved


@dataclass
class PutResult:
    num_stored: int = 0
    num_present: int = 0  # already held (their recency is refreshed)
    rejections: list[str] = field(default_factory=list)  # one reason per block not taken
    events: list[StoreEvent] = field(default_factory=list)  # in the order the changes happened


@dataclass(frozen=True)
class StoreStats:
    num_blocks: int
    num_bytes: int  # block data held
    capacity_bytes: int


class HostBlockStore:
    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._num_bytes = 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def stats(self) -> StoreStats:
        return StoreStats(len(self._blocks), self._num_bytes, self.capacity_bytes)

    def put(self, blocks: Sequence[Block]) -> PutResult:
        """Store `blocks` in order, evicting least recently used ones to make room; bad blocks are skipped."""
        result = PutResult()
        for block in blocks:
            if block.block_hash in self._blocks:
                self._blocks.move_to_end(block.block_hash)
                result.num_present += 1
                continue
            reason = self._rejection(block)
            if reason is not None:
                result.rejections.append(reason)
                continue
            for evicted in self._make_room(len(block.data)):
                _append_removed(result.events, evicted, "capacity")
            self._blocks[block.block_hash] = block
            self._num_bytes += len(block.data)
            _append_stored(result.events, block)
            result.num_stored += 1
        return result

    def get(self, block_hashes: Sequence[bytes], model: str) -> list[Block]:
        """The blocks for `block_hashes` in order, stopping at the first one not held; each hit becomes most
        recently used. A block of another model is a miss (its key could only match by a client's mistake)."""
        found: list[Block] = []
        for block_hash in block_hashes:
            block = self._blocks.get(block_hash)
            if block is None or block.layout.model != model:
                break
            self._blocks.move_to_end(block_hash)
            found.append(block)
        return found

    def lookup(self, block_hashes: Sequence[bytes], model: str) -> int:
        """How many of `block_hashes`, from the first, are held. A probe: recency is left alone."""
        num_hits = 0
        for block_hash in block_hashes:
            block = self._blocks.get(block_hash)
            if block is None or block.layout.model != model:
                break
            num_hits += 1
        return num_hits

    def _rejection(self, block: Block) -> str | None:
        if not block.block_hash:
            return "a block has an empty block_hash"
        name = block.block_hash.hex()[:16]
        if not block.data:
            return f"block {name} has no data"
        if block.layout.dtype not in _DTYPE_BYTES:
            return f"block {name} has an unknown dtype {block.layout.dtype!r}"
        if len(block.data) != block.layout.num_block_bytes:
            return f"block {name} has {len(block.data)} bytes, its layout says {block.layout.num_block_bytes}"
        if len(block.data) > self.capacity_bytes:
            return f"block {name} has {len(block.data)} bytes, more than the store's {self.capacity_bytes}"
        return None

    def _make_room(self, num_bytes: int) -> list[Block]:
        evicted: list[Block] = []
        while self._num_bytes + num_bytes > self.capacity_bytes:
            _, block = self._blocks.popitem(last=False)
            self._num_bytes -= len(block.data)
            evicted.append(block)
        return evicted


def _append_stored(events: list[StoreEvent], block: Block) -> None:
    """Extend the last event when `block` continues its chain, so a Put of one prefix is one event."""
    last = events[-1] if events else None
    if (isinstance(last, BlocksStored) and last.block_hashes[-1] == block.parent_hash
            and last.model == block.layout.model and last.block_size == block.layout.block_size):
        last.block_hashes.append(block.block_hash)
        return
    events.append(BlocksStored([block.block_hash], block.parent_hash, block.layout.block_size, block.layout.model))


def _append_removed(events: list[StoreEvent], block: Block, reason: str) -> None:
    last = events[-1] if events else None
    if isinstance(last, BlocksRemoved) and last.model == block.layout.model and last.reason == reason:
        last.block_hashes.append(block.block_hash)
        return
    events.append(BlocksRemoved([block.block_hash], block.layout.model, reason))
