"""What a KV store node holds and says: blocks (or erasure-coded fragments of blocks), their checksums, and the
events that describe each change. Pure values: no storage, no protobuf.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from mesh.erasure import Protection
from mesh.kv_blocks import DTYPE_BYTES, KVLayout, checksum


class BlockError(ValueError):
    """A block the store does not take (the servicer rejects it with INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Fragment:
    """Which part of its block a stored value is. A whole block is fragment 0 of 1. With erasure coding k+m, the
    block's bytes are split into k data fragments (index < k, the block's bytes in order, the last one zero-padded)
    and m parity fragments; any k of them give the block back."""

    index: int = 0
    num_data: int = 1  # k
    num_total: int = 1  # k + m

    @property
    def is_whole(self) -> bool:
        return self.num_total == 1

    def num_bytes(self, num_block_bytes: int) -> int:
        return -(-num_block_bytes // self.num_data)

    @property
    def protection(self) -> Protection:
        return Protection(self.num_data, self.num_total - self.num_data)


WHOLE = Fragment()


@dataclass(frozen=True)
class Block:
    block_hash: bytes
    parent_hash: bytes  # the key of the block before it in its chain (the chain's root for a first block)
    layout: KVLayout
    data: bytes  # every layer's chunk for this block, layer 0 first (or this fragment's share of those bytes)
    checksum: int | None = None  # CRC-32C of `data`; None: not given (the store computes it)
    fragment: Fragment = WHOLE
    block_checksum: int = 0  # CRC-32C of the whole block (what a reader checks after decoding fragments)
    traffic_class: str = ""  # chooses the TTL; "" is the store's default class

    def with_checksum(self) -> Block:
        if self.checksum is not None:
            return self
        whole = checksum(self.data)
        return replace(self, checksum=whole, block_checksum=self.block_checksum or whole)

    def without_data(self) -> Block:
        return replace(self, data=b"")


def rejection(block: Block, capacity_bytes: int) -> str | None:
    """Why the store cannot take `block`, or None."""
    if not block.block_hash:
        return "a block has an empty block_hash"
    name = block.block_hash.hex()[:16]
    if not block.data:
        return f"block {name} has no data"
    if block.layout.dtype not in DTYPE_BYTES:
        return f"block {name} has an unknown dtype {block.layout.dtype!r}"
    problem = block.layout.block_problem()  # a block format this store cannot size (a newer writer's, or bad)
    if problem is not None:
        return f"block {name}: {problem}"
    fragment = block.fragment
    if not 0 <= fragment.index < fragment.num_total or not 1 <= fragment.num_data <= fragment.num_total:
        return (
            f"block {name} has a bad fragment {fragment.index} of {fragment.num_data}+"
            f"{fragment.num_total - fragment.num_data}"
        )
    expected = fragment.num_bytes(block.layout.num_block_bytes)
    if len(block.data) != expected:
        what = "its layout says" if fragment.is_whole else "a fragment of its layout has"
        return f"block {name} has {len(block.data)} bytes, {what} {expected}"
    if block.checksum is not None and checksum(block.data) != block.checksum:
        return f"block {name} fails its checksum"
    if len(block.data) > capacity_bytes:
        return f"block {name} has {len(block.data)} bytes, more than the store's {capacity_bytes}"
    return None


# -- events -------------------------------------------------------------------------------------------------------
@dataclass
class BlocksStored:
    """A chain of blocks entered a tier: `block_hashes[0]`'s parent is `parent_hash`."""

    block_hashes: list[bytes]
    parent_hash: bytes
    block_size: int
    model: str
    tier: str = "host"
    fragment_indices: list[int] = field(default_factory=list)  # one per key when fragments; empty: whole blocks
    num_data_fragments: int = 1
    num_fragments: int = 1


@dataclass
class BlocksRemoved:
    block_hashes: list[bytes]
    model: str
    reason: str  # capacity | ttl
    tier: str = "host"


StoreEvent = BlocksStored | BlocksRemoved


def append_stored(events: list[StoreEvent], block: Block, tier: str) -> None:
    """Extend the last event when `block` continues its chain, so a Put of one prefix is one event per tier."""
    last = events[-1] if events else None
    fragment = block.fragment
    if (
        isinstance(last, BlocksStored)
        and last.block_hashes[-1] == block.parent_hash
        and last.tier == tier
        and last.model == block.layout.model
        and last.block_size == block.layout.block_size
        and (last.num_data_fragments, last.num_fragments) == (fragment.num_data, fragment.num_total)
    ):
        last.block_hashes.append(block.block_hash)
        if not fragment.is_whole:
            last.fragment_indices.append(fragment.index)
        return
    indices = [] if fragment.is_whole else [fragment.index]
    events.append(
        BlocksStored(
            [block.block_hash],
            block.parent_hash,
            block.layout.block_size,
            block.layout.model,
            tier,
            indices,
            fragment.num_data,
            fragment.num_total,
        )
    )


def append_removed(events: list[StoreEvent], key: bytes, model: str, reason: str, tier: str) -> None:
    last = events[-1] if events else None
    if isinstance(last, BlocksRemoved) and (last.model, last.reason, last.tier) == (model, reason, tier):
        last.block_hashes.append(key)
        return
    events.append(BlocksRemoved([key], model, reason, tier))


def layer_major_slices(
    datas: Sequence[bytes], slice_bytes: int, chunk_bytes: int
) -> Iterator[tuple[int, int, list[memoryview]]]:
    """Slice s (bytes [s * slice_bytes, (s + 1) * slice_bytes)) of every block in order, in chunks of about
    chunk_bytes: (offset, the chunk's first block, its pieces). See GetRequest.slice_bytes."""
    if slice_bytes <= 0 or not datas:
        return
    views = [memoryview(data) for data in datas]
    for offset in range(0, max(len(v) for v in views), slice_bytes):
        first, parts, size = 0, [], 0
        for index, view in enumerate(views):
            part = view[offset : offset + slice_bytes]
            parts.append(part)
            size += len(part)
            if size >= chunk_bytes or index == len(views) - 1:
                yield offset, first, parts
                first, parts, size = index + 1, [], 0
