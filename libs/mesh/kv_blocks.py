"""The KV block format that the engines, prefill, decode and the KV store share: how to read a block's bytes
(`KVLayout`), its checksum, and the layout's protobuf form (common.proto's KVLayout).

No torch here, so that a store node can use it without the engine's dependencies: the engine's tensor views of
these bytes live in engine_core.kv_transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import crc32c

from mesh.pb import common_pb2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes a KV block may hold, and their sizes


class KVLayoutError(ValueError):
    """KV bytes that this engine cannot take: another model, dtype, block size or shape."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C of a block's (or fragment's) bytes: carried with the block, checked by the store and the reader.

    Castagnoli's polynomial, as storage systems and gRPC use, because CPUs compute it in hardware (SSE4.2, ARMv8):
    about 16 GB/s here against zlib's CRC-32 at 4 GB/s, which on its own capped a reader near the speed of the
    loopback it reads from."""
    return crc32c.crc32c(data)


def checksum_more(data: bytes | bytearray | memoryview, value: int) -> int:
    """The checksum of bytes whose start summed to `value`, once `data` follows them (a block summed piece by
    piece as it arrives). Releases the GIL for large pieces."""
    return crc32c.crc32c(data, value)


@dataclass(frozen=True)
class KVLayout:
    """How to read KV bytes: the engine's block format, as the wire's KVLayout carries it. A block holds every
    layer's chunk for that block, layer 0 first; a transfer's chunk holds one layer for several blocks."""

    model: str  # the model's served name: KV of one model is meaningless to another
    dtype: str  # float32 | bfloat16 | float16
    block_size: int  # tokens per block
    num_layers: int
    layer_shape: tuple[int, ...]  # one layer's chunk for ONE block (the block axis has size 1)
    block_axis: int  # which axis of layer_shape counts blocks

    def chunk_shape(self, num_blocks: int) -> tuple[int, ...]:
        shape = list(self.layer_shape)
        shape[self.block_axis] = num_blocks
        return tuple(shape)

    def chunk_bytes(self, num_blocks: int) -> int:
        """Bytes of one layer's chunk for `num_blocks` blocks. KeyError for a dtype not in DTYPE_BYTES."""
        numel = 1
        for size in self.chunk_shape(num_blocks):
            numel *= size
        return numel * DTYPE_BYTES[self.dtype]

    @property
    def num_block_bytes(self) -> int:
        """Bytes of one block across every layer: num_layers * chunk_bytes(1) for a well-formed layout, computed
        without block_axis so that a store can size a block from the wire before trusting the axis."""
        numel = 1
        for size in self.layer_shape:
            numel *= size
        return self.num_layers * numel * DTYPE_BYTES[self.dtype]

    def check_compatible(self, other: KVLayout) -> None:
        if self != other:
            raise KVLayoutError(f"KV layout mismatch: got {other}, this engine uses {self}")


def layout_from_proto(layout: common_pb2.KVLayout) -> KVLayout:
    return KVLayout(
        model=layout.model,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        layer_shape=tuple(layout.layer_shape),
        block_axis=layout.block_axis,
    )


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        model=layout.model,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        layer_shape=layout.layer_shape,
        block_axis=layout.block_axis,
    )
