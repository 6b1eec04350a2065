"""The KV block format that the engines, prefill, decode and the KV store share: how to read a block's bytes
(`KVLayout`), its checksum, and the layout's protobuf form (common.proto's KVLayout).

Two formats. Format 1, paged blocks (Llama, DeepSeek-V3): every layer's KV of a block has the same shape
(`layer_shape`), a transfer chunk is some blocks of one layer. Format 2, per-layer-type sections (DeepSeek-V4,
`KVLayout.sections` set): a request's KV is its per-sequence state, one section per layer whose contents depend on
the layer's type (window-only, CSA, HCA) and on the request's token count (`StateSections`); a transfer chunk is
one layer's whole section. A layout of one format never equals one of the other, so KV of one is never read as
the other: a reader finds a layout mismatch (a miss), not bytes to misread.

No torch here, so that a store node can use it without the engine's dependencies: the engine's tensor views of
these bytes live in engine_core.kv_transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import crc32c

from mesh.pb import common_pb2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes a KV block may hold, and their sizes
LAYER_KINDS = ("window", "csa", "hca")  # format 2: window-only, compressed sparse, heavily compressed attention


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
class StateSections:
    """Format 2: what one layer's section of a request's state holds after `num_tokens` tokens, in order.

    Every layer: `window`, the latest min(n, sliding_window - 1) tokens' KV vectors (n x D). CSA and HCA layers
    then their compressor's state: `tail_kv` and `tail_gate` (the n % m tokens of the open window, c x D wide,
    c = 2 series on CSA, 1 on HCA), `entries` (n // m closed windows, D wide), and on CSA, once a window closed,
    `overlap_kv` and `overlap_gate` (m x D: the last closed window's first series; the gates in float32, the rest in
    the model's dtype). CSA layers then the same five for the lightning indexer (index_head_dim wide, c = 2)."""

    layer_kinds: tuple[str, ...]  # per layer: window | csa | hca
    head_dim: int
    index_head_dim: int
    sliding_window: int
    csa_ratio: int
    hca_ratio: int

    def tensors(self, layer: int, num_tokens: int, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of each tensor of `layer`'s section, in order. KVLayoutError for a layer or a
        geometry that cannot be read."""
        if not 0 <= layer < len(self.layer_kinds) or num_tokens < 0:
            raise KVLayoutError(f"no section for layer {layer} of {len(self.layer_kinds)} at {num_tokens} tokens")
        kind = self.layer_kinds[layer]
        ratio = {"window": 1, "csa": self.csa_ratio, "hca": self.hca_ratio}.get(kind, 0)
        if ratio <= 0 or self.sliding_window < 1 or min(self.head_dim, self.index_head_dim) < 0:
            raise KVLayoutError(f"unreadable state sections: layer {layer} is {kind!r} in {self}")
        window = ("window", (min(num_tokens, self.sliding_window - 1), self.head_dim), dtype)
        if kind == "window":
            return [window]
        series = 2 if kind == "csa" else 1
        out = [window, *_compressor_tensors("compressor", self.head_dim, ratio, series, num_tokens, dtype)]
        if kind == "csa":
            out += _compressor_tensors("indexer", self.index_head_dim, ratio, 2, num_tokens, dtype)
        return out

    def layer_bytes(self, layer: int, num_tokens: int, dtype: str) -> int:
        return sum(math.prod(shape) * DTYPE_BYTES[kind] for _, shape, kind in self.tensors(layer, num_tokens, dtype))


def _compressor_tensors(
    name: str, width: int, ratio: int, series: int, num_tokens: int, dtype: str
) -> list[tuple[str, tuple[int, ...], str]]:
    tail = num_tokens % ratio
    out: list[tuple[str, tuple[int, ...], str]] = [
        (f"{name}.tail_kv", (tail, series * width), dtype),
        (f"{name}.tail_gate", (tail, series * width), dtype),
        (f"{name}.entries", (num_tokens // ratio, width), dtype),
    ]
    if series == 2 and num_tokens >= ratio:
        out += [(f"{name}.overlap_kv", (ratio, width), dtype), (f"{name}.overlap_gate", (ratio, width), "float32")]
    return out


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
    sections: StateSections | None = None  # format 2 (per-sequence state); None: format 1 (paged blocks)

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

    def transfer_chunk_bytes(self, layer: int, num_blocks: int, num_tokens: int) -> int:
        """Bytes of one transfer chunk of a request of `num_tokens` tokens: format 1, `num_blocks` blocks of one
        layer; format 2, the whole section of `layer` (KVLayoutError for a layer out of range)."""
        if self.sections is None:
            return self.chunk_bytes(num_blocks)
        if not 0 <= layer < self.num_layers:
            raise KVLayoutError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.sections.layer_bytes(layer, num_tokens, self.dtype)

    def transfer_bytes(self, num_blocks: int, num_tokens: int) -> int:
        """Bytes of a whole transfer: every layer of a request's `num_blocks` blocks (`num_tokens` tokens)."""
        if self.sections is None:
            return self.num_layers * self.chunk_bytes(num_blocks)
        return sum(self.transfer_chunk_bytes(layer, num_blocks, num_tokens) for layer in range(self.num_layers))

    def check_compatible(self, other: KVLayout) -> None:
        if self != other:
            raise KVLayoutError(f"KV layout mismatch: got {other}, this engine uses {self}")


def layout_from_proto(layout: common_pb2.KVLayout) -> KVLayout:
    sections = None
    if layout.HasField("sections"):
        s = layout.sections
        sections = StateSections(
            tuple(s.layer_kinds), s.head_dim, s.index_head_dim, s.sliding_window, s.csa_ratio, s.hca_ratio
        )
    return KVLayout(
        model=layout.model,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        layer_shape=tuple(layout.layer_shape),
        block_axis=layout.block_axis,
        sections=sections,
    )


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    """Format 1 layouts are written exactly as before format 2 existed (no `sections` field)."""
    proto = common_pb2.KVLayout(
        model=layout.model,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        layer_shape=layout.layer_shape,
        block_axis=layout.block_axis,
    )
    if layout.sections is not None:
        s = layout.sections
        proto.sections.CopyFrom(
            common_pb2.KVStateSections(
                layer_kinds=s.layer_kinds,
                head_dim=s.head_dim,
                index_head_dim=s.index_head_dim,
                sliding_window=s.sliding_window,
                csa_ratio=s.csa_ratio,
                hca_ratio=s.hca_ratio,
            )
        )
    return proto
