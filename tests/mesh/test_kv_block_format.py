"""The versioned KV block format (mesh.kv_blocks): format 1 blocks (Llama, DeepSeek-V3) are the bytes they always
were; format 2 blocks (DeepSeek-V4) hold each layer's sections by its kind, without padding; a block whose format
cannot be read is refused by the store and is a miss for a reader, never a crash."""

from __future__ import annotations

import dataclasses

import pytest

from engine_core.config import ModelConfig
from engine_core.models.deepseek_v4.shapes import V4_FLASH
from engine_core.models.deepseek_v4.transfer import block_sections
from engine_core.tiny_v4 import DEEPSEEK_V4_TINY_CONFIG
from mesh import erasure
from mesh.kv_blocks import BlockSections, KVLayout, KVLayoutError, checksum, layout_from_proto, layout_to_proto
from services.kvcache.blocks import Block, Fragment, rejection
from services.kvcache.codec import block_to_pb
from services.prefill.store_reads import Fetched, assemble

KEY, PARENT = bytes([7]) * 32, bytes(32)


def v4_layout(raw: dict, block_size: int, dtype: str) -> KVLayout:
    config = ModelConfig.from_hf(raw)
    assert config.v4 is not None
    sections = block_sections(config.v4, block_size)
    return KVLayout("m", dtype, block_size, config.num_layers, (), 0, block_format=2, block_sections=sections)


def test_a_format_1_block_is_the_same_message_and_checksum_as_before_formats_had_numbers() -> None:
    """Pinned from the code before block formats (commit a076c23): a V3 block's message and CRC-32C, byte for byte."""
    layout = KVLayout("deepseek-tiny", "float16", 2, 2, (1, 2, 4), 0)
    block = Block(KEY, PARENT, layout, bytes(range(32))).with_checksum()
    assert block.checksum == checksum(bytes(range(32))) == 0x46DD794E
    assert block_to_pb(block).SerializeToString().hex() == (
        "0a20" + "07" * 32 + "1220" + "00" * 32 + "1a210a0d646565707365656b2d74696e791207666c6f61743136180220022a03"
        "010204" + "2220" + bytes(range(32)).hex() + "28cef2f5b60430cef2f5b604"
    )
    assert layout.block_format == 1 and layout.num_block_bytes == 32 and layout.layer_offsets() == (0, 16, 32)


def test_deepseek_v4_tiny_blocks_hold_each_layer_kinds_sections() -> None:
    """Blocks of 16 tokens, fp32 (the CPU's dtype), head_dim 64, indexer 32, CSA ratio 4, HCA ratio 16."""
    layout = v4_layout(DEEPSEEK_V4_TINY_CONFIG, 16, "float32")
    assert layout.block_sections is not None
    assert dict(layout.block_sections.kinds) == {
        "window": (("window", 16, 64),),
        "csa": (
            ("window", 16, 64),
            ("entries", 4, 64),
            ("overlap_kv", 4, 64),
            ("overlap_gate", 4, 64),
            ("index_entries", 4, 32),
            ("index_overlap_kv", 4, 32),
            ("index_overlap_gate", 4, 32),
        ),
        "hca": (("window", 16, 64), ("entries", 1, 64)),
    }
    assert layout.block_sections.layer_kinds == ("window", "csa", "hca", "csa")
    csa = (16 * 64 + 3 * 4 * 64 + 3 * 4 * 32) * 4
    assert [layout.layer_bytes(i) for i in range(4)] == [4096, csa, (16 * 64 + 64) * 4, csa] == [4096, 8704, 4352, 8704]
    assert layout.layer_offsets() == (0, 4096, 12800, 17152, 25856)
    assert layout.num_block_bytes == 25_856  # = the engine's pools per block; one padded tensor: 4 x 8704 = 34,816
    proto = layout_to_proto(layout)
    assert proto.block_format == 2 and layout_from_proto(proto) == layout
    assert layout != dataclasses.replace(layout, block_format=1, block_sections=None, layer_shape=(1, 2176))


def test_v4_flash_blocks_of_128_in_bf16() -> None:
    """docs/kvcache.md's V4-Flash figures: 2 window-only, 21 CSA and 20 HCA layers."""
    layout = v4_layout(V4_FLASH, 128, "bfloat16")
    assert layout.block_sections is not None
    kinds = layout.block_sections.layer_kinds
    assert (kinds.count("window"), kinds.count("csa"), kinds.count("hca")) == (2, 21, 20)
    assert {layout.layer_bytes(i) for i in range(43)} == {131_072, 182_272, 132_096}
    assert layout.num_block_bytes == 2 * 131_072 + 21 * 182_272 + 20 * 132_096 == 6_731_776
    assert layout.num_block_bytes // 128 == 52_592  # per token, against 61,232 in rows padded to the widest


def test_the_store_takes_v4_blocks_whole_or_erasure_coded_and_checks_their_size() -> None:
    layout = v4_layout(DEEPSEEK_V4_TINY_CONFIG, 16, "float32")
    data = bytes(range(256)) * 101  # 25,856 bytes
    assert rejection(Block(KEY, PARENT, layout, data).with_checksum(), 2**20) is None
    assert rejection(Block(KEY, PARENT, layout, data[:-4]), 2**20) == (
        f"block {KEY.hex()[:16]} has 25852 bytes, its layout says 25856"
    )
    fragments = erasure.encode(data, 2, 3)
    assert [len(f) for f in fragments] == [12_928] * 3
    for index, fragment in enumerate(fragments):
        coded = Block(KEY, PARENT, layout, fragment, fragment=Fragment(index, 2, 3), block_checksum=checksum(data))
        assert rejection(coded.with_checksum(), 2**20) is None
    assert erasure.decode({0: fragments[0], 2: fragments[2]}, 2, 3, layout.num_block_bytes) == data


def test_an_unknown_or_malformed_block_format_is_refused_by_the_store_and_a_miss_for_a_reader() -> None:
    tiny = v4_layout(DEEPSEEK_V4_TINY_CONFIG, 16, "float32")
    assert tiny.block_sections is not None
    newer = dataclasses.replace(tiny, block_format=3)
    undescribed = dataclasses.replace(
        tiny, block_sections=BlockSections(tiny.block_sections.kinds[:2], tiny.block_sections.layer_kinds)
    )
    short = dataclasses.replace(tiny, num_layers=5)
    unsectioned = dataclasses.replace(tiny, block_sections=None)
    assert [layout.block_problem() for layout in (newer, undescribed, short, unsectioned)] == [
        "block format 3 is not one of (1, 2)",
        "block sections have layers of undescribed kinds ['hca']",
        "block sections give 4 layer kinds for 5 layers",
        "block format 2 needs sections",
    ]
    with pytest.raises(KVLayoutError, match="unreadable KV block layout: block format 3"):
        newer.num_block_bytes  # noqa: B018
    data = bytes(25_856)
    assert rejection(Block(KEY, PARENT, newer, data), 2**20) == (
        f"block {KEY.hex()[:16]}: block format 3 is not one of (1, 2)"
    )
    # a reader given such a block (a newer node's) decodes nothing and stops: the prefix ends before it
    meta = block_to_pb(Block(KEY, PARENT, newer, b"", checksum=checksum(data), block_checksum=checksum(data)))
    assert assemble([KEY], {KEY: Fetched({0: data}, meta)}) == []
    known = block_to_pb(Block(KEY, PARENT, tiny, b"", checksum=checksum(data), block_checksum=checksum(data)))
    assert [b.layout for b in assemble([KEY], {KEY: Fetched({0: data}, known)})] == [tiny]
