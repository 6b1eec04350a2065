"""Moving a request's KV between engines: layer-major chunks of raw bytes, described by a KVLayout.

An export is the request's blocks, one chunk per layer (so a transfer can stream layer by layer and the
receiver can start on early layers while later ones travel). A chunk is the bytes of that layer's cache
restricted to the request's blocks, in the engine's own block format: the descriptor says how to read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mesh.kv_blocks import KVLayout, KVLayoutError, StateSections

__all__ = [
    "KVChunk",
    "KVExport",
    "KVLayout",
    "KVLayoutError",
    "StateSections",
    "block_bytes_to_tensor",
    "bytes_to_tensor",
    "dtype_name",
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


def block_bytes_to_tensor(data: bytes, layout: KVLayout) -> torch.Tensor:
    """One block's KV across every layer (as a KV store holds it): (num_layers, *layer_shape)."""
    expected = layout.num_layers * layout.chunk_bytes(1)
    if len(data) != expected:
        raise KVLayoutError(f"KV block has {len(data)} bytes, expected {expected}")
    return uint8_view(data).view(torch_dtype(layout)).view(layout.num_layers, *layout.layer_shape)


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
        """Layer-major chunks, layer 0 first; a layer larger than `max_bytes` comes in several (format 1; in
        format 2 a chunk is a layer's whole section: `_read(layer, 0, num_blocks)`)."""
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
