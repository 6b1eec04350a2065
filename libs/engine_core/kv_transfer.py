"""Moving a request's KV between engines: layer-major chunks of raw bytes, described by a KVLayout.

An export is the request's blocks, one chunk per layer (so a transfer can stream layer by layer and the
receiver can start on early layers while later ones travel). A chunk is the bytes of that layer's cache
restricted to the request's blocks, in the engine's own block format: the descriptor says how to read it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from mesh.kv_blocks import BlockSections, KVLayout, KVLayoutError, Section, StateSections

__all__ = [
    "BlockSections",
    "KVChunk",
    "KVExport",
    "KVLayout",
    "KVLayoutError",
    "Section",
    "StateSections",
    "block_bytes_to_tensor",
    "bytes_to_tensor",
    "dtype_name",
    "layer_bytes_to_tensor",
    "named_dtype",
    "tensor_to_bytes",
    "torch_dtype",
    "uint8_view",
]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAME_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return _NAME_DTYPES[layout.dtype]


def named_dtype(name: str) -> torch.dtype:
    """float32 | bfloat16 | float16 -> the torch dtype; KVLayoutError for another name."""
    if name not in _NAME_DTYPES:
        raise KVLayoutError(f"KV dtype {name!r} is not one of {', '.join(_NAME_DTYPES)}")
    return _NAME_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def uint8_view(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 view of `data` when it is writable (received into), else of a writable copy."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)  # frombuffer refuses an empty buffer
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    return torch.frombuffer(data if writable else bytearray(data), dtype=torch.uint8)


def bytes_to_tensor(data: bytes | bytearray | memoryview, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    expected = layout.chunk_bytes(num_blocks)
    if len(data) != expected:
        raise KVLayoutError(f"KV chunk has {len(data)} bytes, expected {expected} for {num_blocks} blocks")
    return uint8_view(data).view(torch_dtype(layout)).view(layout.chunk_shape(num_blocks))


# A block's bytes (`layout.block_format`) and the engine's cache: in format 1 a block is the cache's rows of it, every
# layer alike; in format 2 (DeepSeek-V4) a layer's elements are its sections back to back, and the cache's
# per-layer-type pools place them (models.deepseek_v4.paged_pools), so these functions give them flat.


def block_bytes_to_tensor(data: bytes | bytearray | memoryview, layout: KVLayout) -> torch.Tensor:
    """One block's stored bytes -> format 1: (num_layers, *layer_shape) as the cache holds it; format 2: its
    elements, flat. KVLayoutError when the bytes are not the layout's block size."""
    expected = layout.num_block_bytes
    if len(data) != expected:
        raise KVLayoutError(f"KV block has {len(data)} bytes, expected {expected}")
    values = uint8_view(data).view(torch_dtype(layout))
    if layout.block_sections is None:
        return values.view(layout.num_layers, *layout.layer_shape)
    return values


def layer_bytes_to_tensor(
    pieces: Sequence[bytes | bytearray | memoryview], layout: KVLayout, block_axis: int
) -> torch.Tensor:
    """One layer of several blocks, each block's bytes of it as a stored block holds them -> format 1: that layer's
    rows of those blocks as the cache holds them, blocks along `block_axis`; format 2: (blocks, the layer's
    elements). Read-only buffers are copied."""
    dtype = torch_dtype(layout)
    with warnings.catch_warnings():  # read-only buffers are fine: cat and stack copy them
        warnings.simplefilter("ignore", UserWarning)
        values = [torch.frombuffer(piece, dtype=dtype) for piece in pieces]
    if layout.block_sections is None:
        return torch.cat([value.view(layout.layer_shape) for value in values], block_axis)
    return torch.stack(values)


@dataclass(frozen=True)
class KVChunk:
    """Blocks [first_block, first_block + num_blocks) of a request, in one layer."""

    layer: int
    first_block: int
    num_blocks: int
    data: bytes | bytearray | memoryview  # layout.chunk_shape(num_blocks), raw


@dataclass(frozen=True)
class KVExport:
    """A request's KV, ready to send: iterate `chunks()` before the request is released."""

    layout: KVLayout
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens sampled so far (after prefill: the first token)
    num_tokens: int  # tokens whose KV the chunks hold (all prompt tokens, after prefill)
    num_blocks: int
    _read: Callable[[int, int, int], bytes]  # (layer, first_block, num_blocks) -> bytes

    def chunks(self, max_bytes: int | None = None) -> Iterator[KVChunk]:
        """Layer-major chunks, layer 0 first; a layer larger than `max_bytes` comes in several (blocks; a
        state's chunk is a layer's whole section: `_read(layer, 0, num_blocks)`)."""
        if self.layout.sections is not None:
            for layer in range(self.layout.num_layers):
                yield KVChunk(layer, 0, self.num_blocks, self._read(layer, 0, self.num_blocks))
            return
        per_chunk = self.num_blocks
        if max_bytes is not None:
            per_chunk = max(1, min(self.num_blocks, max_bytes // self.layout.chunk_bytes(1)))
        for layer in range(self.layout.num_layers):
            for first in range(0, self.num_blocks, per_chunk):
                count = min(per_chunk, self.num_blocks - first)
                yield KVChunk(layer, first, count, self._read(layer, first, count))
