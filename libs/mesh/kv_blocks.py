"""The KV block format that the engines, prefill, decode and the KV store share: how to read a block's bytes
(`KVLayout`), its checksum, and the layout's protobuf form (common.proto's KVLayout).

A block (the prefix cache's unit, what a KV store holds) comes in a versioned format, `KVLayout.block_format`:
- Format 1, uniform layers (Llama, DeepSeek-V3): every layer's KV of a block has the same shape (`layer_shape`);
  a block is its layers' chunks, layer 0 first. Its bytes and its layout's protobuf are as before formats had
  numbers.
- Format 2, per-layer-type sections (DeepSeek-V4, `BlockSections`): a layer's bytes in a block are its kind's
  sections back to back (window vectors, compressed entries, indexer keys, overlaps), so layers differ in size
  and a block holds no padding; layer 0 first.
A layout of one format never equals one of the other, and a reader compares layouts before it reads, so a block of
one is a miss for an engine of the other, never bytes to misread; an unknown format number is unreadable
(`KVLayout.block_problem`): the store refuses it and a reader treats it as a miss.

Moving a request between engines (P/D handoff) uses the same layout: format 1 sends blocks; a model with
per-sequence state (DeepSeek-V4, `KVLayout.sections` set) sends that state instead, one section per layer whose
contents depend on the layer's type and the request's token count (`StateSections`); a transfer chunk is then one
layer's whole section.

No torch here, so that a store node can use it without the engine's dependencies: the engine's tensor views of
these bytes live in engine_core.kv_transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import crc32c

from mesh.pb import common_pb2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes a KV block may hold, and their sizes
LAYER_KINDS = ("window", "csa", "hca")  # V4: window-only, compressed sparse, heavily compressed attention
BLOCK_FORMATS = (1, 2)  # the block formats this code reads (module docstring)


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
    """A handoff of per-sequence state (V4): what one layer's section of a request's state holds after
    `num_tokens` tokens, in order.

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


Section = tuple[str, int, int]  # (name, rows, width): rows x width elements of the layout's dtype


@dataclass(frozen=True)
class BlockSections:
    """Block format 2: what each layer of a block holds, by the layer's kind. A layer's bytes are its kind's
    sections back to back; the block is its layers' bytes, layer 0 first."""

    kinds: tuple[tuple[str, tuple[Section, ...]], ...]  # (kind, its sections in order), each kind once
    layer_kinds: tuple[str, ...]  # per layer: one of the kinds' names

    def sections(self, layer: int) -> tuple[Section, ...]:
        return dict(self.kinds)[self.layer_kinds[layer]]

    def layer_numel(self, layer: int) -> int:
        """Elements of `layer` in one block."""
        return sum(rows * width for _, rows, width in self.sections(layer))

    def problem(self, num_layers: int) -> str | None:
        """Why blocks of these sections cannot be sized, or None."""
        names = [name for name, _ in self.kinds]
        if len(set(names)) != len(names):
            return f"block sections name a layer kind twice: {names}"
        if len(self.layer_kinds) != num_layers:
            return f"block sections give {len(self.layer_kinds)} layer kinds for {num_layers} layers"
        unknown = sorted(set(self.layer_kinds) - set(names))
        if unknown:
            return f"block sections have layers of undescribed kinds {unknown}"
        for name, sections in self.kinds:
            if not sections or any(rows < 0 or width < 0 for _, rows, width in sections):
                return f"block sections of kind {name!r} are empty or negative: {sections}"
        return None


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
    sections: StateSections | None = None  # a handoff of per-sequence state (V4); None: blocks
    block_format: int = 1  # 1: uniform layers (`layer_shape`); 2: per-layer-type sections (`block_sections`)
    block_sections: BlockSections | None = None  # format 2 only

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

    def block_problem(self) -> str | None:
        """Why blocks of this layout cannot be read or sized, or None: an unknown format, dtype or sections."""
        if self.block_format not in BLOCK_FORMATS:
            return f"block format {self.block_format} is not one of {BLOCK_FORMATS}"
        if self.dtype not in DTYPE_BYTES:
            return f"unknown dtype {self.dtype!r}"
        if (self.block_format == 2) != (self.block_sections is not None):
            return f"block format {self.block_format} {'needs' if self.block_format == 2 else 'takes no'} sections"
        if self.block_sections is not None:
            return self.block_sections.problem(self.num_layers)
        return None

    def layer_bytes(self, layer: int) -> int:
        """Bytes of `layer` in one block (every layer alike in format 1)."""
        if self.block_sections is None:
            return math.prod(self.layer_shape) * DTYPE_BYTES[self.dtype]
        return self.block_sections.layer_numel(layer) * DTYPE_BYTES[self.dtype]

    def layer_offsets(self) -> tuple[int, ...]:
        """Where each layer starts in a block's bytes, and (last) where the block ends: num_layers + 1 offsets."""
        offsets = [0]
        for layer in range(self.num_layers):
            offsets.append(offsets[-1] + self.layer_bytes(layer))
        return tuple(offsets)

    @property
    def num_block_bytes(self) -> int:
        """Bytes of one block across every layer: num_layers * chunk_bytes(1) for a well-formed format 1 layout,
        computed without block_axis so that a store can size a block from the wire before trusting the axis.
        KVLayoutError for a layout whose blocks cannot be sized (`block_problem`)."""
        problem = self.block_problem()
        if problem is not None:
            raise KVLayoutError(f"unreadable KV block layout: {problem}")
        if self.block_sections is None:
            return self.num_layers * self.layer_bytes(0)
        return sum(self.layer_bytes(layer) for layer in range(self.num_layers))

    def transfer_chunk_bytes(self, layer: int, num_blocks: int, num_tokens: int) -> int:
        """Bytes of one transfer chunk of a request of `num_tokens` tokens: `num_blocks` blocks of one layer, or with
        state sections the whole section of `layer` (KVLayoutError for a layer out of range)."""
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
    block_sections = None
    if layout.HasField("block_sections"):
        b = layout.block_sections
        kinds = tuple((k.name, tuple((s.name, s.rows, s.width) for s in k.sections)) for k in b.kinds)
        block_sections = BlockSections(kinds, tuple(b.layer_kinds))
    return KVLayout(
        model=layout.model,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        layer_shape=tuple(layout.layer_shape),
        block_axis=layout.block_axis,
        sections=sections,
        block_format=layout.block_format or 1,  # unset on the wire: format 1
        block_sections=block_sections,
    )


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    """Format 1 layouts are written exactly as before formats had numbers (fields 1-6 only)."""
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
    if layout.block_format != 1:
        proto.block_format = layout.block_format
    if layout.block_sections is not None:
        kinds = [
            common_pb2.KVLayerKind(
                name=name, sections=[common_pb2.KVSection(name=n, rows=r, width=w) for n, r, w in sections]
            )
            for name, sections in layout.block_sections.kinds
        ]
        proto.block_sections.CopyFrom(
            common_pb2.KVBlockSections(kinds=kinds, layer_kinds=layout.block_sections.layer_kinds)
        )
    return proto
