"""kvcache.proto <-> the store's values, in one place (the servicer and the SSD tier's file headers use it)."""

from __future__ import annotations

from mesh.kv_blocks import layout_from_proto, layout_to_proto
from mesh.pb import kvcache_pb2
from services.kvcache.blocks import WHOLE, Block, BlockError, Fragment


def fragment_from_pb(block: kvcache_pb2.Block) -> Fragment:
    if block.num_fragments <= 1:
        return WHOLE
    return Fragment(block.fragment_index, block.num_data_fragments, block.num_fragments)


def block_from_pb(block: kvcache_pb2.Block, data: bytes | None = None) -> Block:
    """`data`: the block's bytes when they did not travel inside the message (the bulk lane's payloads)."""
    if not block.HasField("layout"):
        raise BlockError(f"block {block.block_hash.hex()[:16]} has no layout")
    return Block(
        block.block_hash,
        block.parent_hash,
        layout_from_proto(block.layout),
        block.data if data is None else data,
        checksum=block.checksum if block.HasField("checksum") else None,
        fragment=fragment_from_pb(block),
        block_checksum=block.block_checksum,
        traffic_class=block.traffic_class,
    )


def block_to_pb(block: Block, tier: str = "") -> kvcache_pb2.Block:
    fragment = block.fragment
    return kvcache_pb2.Block(
        block_hash=block.block_hash,
        parent_hash=block.parent_hash,
        layout=layout_to_proto(block.layout),
        data=block.data,
        checksum=block.checksum,
        block_checksum=block.block_checksum,
        fragment_index=fragment.index,
        num_data_fragments=0 if fragment.is_whole else fragment.num_data,
        num_fragments=0 if fragment.is_whole else fragment.num_total,
        traffic_class=block.traffic_class,
        tier=tier,
    )
