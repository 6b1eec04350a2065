"""The layer stream's running checksums (services.prefill.store_stream): whole blocks summed slice by slice as the
lane lands them, so the end check reads no block again; a block whose slices did not land in order, or a coded
fragment, is left to be read again, never passed on a partial sum."""

from __future__ import annotations

import os

from mesh.kv_blocks import KVLayout, checksum
from mesh.lane import BufferPool
from services.prefill.store_stream import LandingSums, StreamBuffers

LAYOUT = KVLayout("m", "float16", 16, 4, (2, 1, 16, 1, 8), 1)  # 4 layers of 512 bytes


def land_chunk(buffers: StreamBuffers, blocks: list[bytes], indices: list[int], offset: int, size: int) -> None:
    """One chunk: a slice of each block in `indices` at `offset`, landed in two parts each as lane_io hands them."""
    landed = LandingSums(buffers, indices, offset)
    for n, index in enumerate(indices):
        region = buffers.region(index, 0, offset, size)
        region[:] = blocks[index][offset : offset + size]
        landed(n, region[: size // 2])
        landed(n, region[size // 2 :])
    landed.commit()
    for index in indices:
        buffers.mark(index, 0, offset + size)


def test_whole_blocks_are_summed_as_they_land_and_checked_without_a_second_read() -> None:
    blocks = [os.urandom(LAYOUT.num_layers * LAYOUT.chunk_bytes(1)) for _ in range(3)]
    buffers = StreamBuffers(LAYOUT, [1, 1, 1], BufferPool(2**20))
    layer_bytes = LAYOUT.chunk_bytes(1)
    for layer in range(LAYOUT.num_layers):
        land_chunk(buffers, blocks, [0, 1, 2], layer * layer_bytes, layer_bytes)
    assert buffers.running == {i: (checksum(block), len(block)) for i, block in enumerate(blocks)}
    buffers.block_checksums = {i: checksum(block) for i, block in enumerate(blocks)}
    assert [buffers.is_checked(i) for i in range(3)] == [True, True, True]
    buffers.block_checksums[1] ^= 1  # a checksum the bytes do not match fails
    assert [buffers.is_checked(i) for i in range(3)] == [True, False, True]


def test_a_slice_out_of_order_or_a_fragment_is_not_summed_and_is_read_again() -> None:
    block_bytes = LAYOUT.num_layers * LAYOUT.chunk_bytes(1)
    blocks = [os.urandom(block_bytes) for _ in range(2)]
    buffers = StreamBuffers(LAYOUT, [1, 2], BufferPool(2**20))  # block 1: a data fragment of a 2+m block
    layer_bytes = LAYOUT.chunk_bytes(1)
    land_chunk(buffers, blocks, [0], layer_bytes, layer_bytes)  # layer 1 of block 0 before its layer 0
    land_chunk(buffers, blocks, [1], 0, layer_bytes)
    assert buffers.running == {}
    for layer in (0, 2, 3):
        land_chunk(buffers, blocks, [0], layer * layer_bytes, layer_bytes)
    # block 0: only its layer 0, which landed in order; layers 2 and 3 followed a gap. Block 1: a fragment, never
    assert buffers.running == {0: (checksum(blocks[0][:layer_bytes]), layer_bytes)}
    buffers.block_checksums = {0: checksum(blocks[0])}
    assert buffers.is_checked(0)  # read again, whole
