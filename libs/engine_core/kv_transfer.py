"""Moving a request's KV between engines: a layout descriptor and layer-major chunks of raw bytes.

An export is the request's blocks, one chunk per layer (so a transfer can stream layer by layer and the
receiver can start on early layers while later ones travel). A chunk is the bytes of that layer's cache
restricted to the request's blocks, in the engine's own block format: the descriptor says how to read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAME_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class KVLayoutError(ValueError):
    """KV bytes that this engine cannot take: another model, dtype, block size or shape."""


@dataclass(frozen=True)
class KVLayout:
    model: str  # the model's served name: KV of one model is meaningless to another
    dtype: str  # float32 | bfloat16 | float16
    block_size: int  # tokens per block
    num_layers: int
    layer_shape: tuple[int, ...]  # one layer's chunk for ONE block (the block axis has size 1)
    block_axis: int  # which axis of layer_shape counts blocks

    @property
    def torch_dtype(self) -> torch.dtype:
        return _NAME_DTYPES[self.dtype]

    def chunk_shape(self, num_blocks: int) -> tuple[int, ...]:
        shape = list(self.layer_shape)
        shape[self.block_axis] = num_blocks
        return tuple(shape)

    def chunk_bytes(self, num_blocks: int) -> int:
        numel = 1
        for size in self.chunk_shape(num_blocks):
            numel *= size
        return numel * self.torch_dtype.itemsize

    def check_compatible(self, other: KVLayout) -> None:
        if self != other:
            raise KVLayoutError(f"KV layout mismatch: got {other}, this engine uses {self}")


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _as_bytes_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 view of `data` when it is writable (received into), else of a writable copy."""
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    return torch.frombuffer(data if writable else bytearray(data), dtype=torch.uint8)


def bytes_to_tensor(data: bytes | bytearray | memoryview, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    expected = layout.chunk_bytes(num_blocks)
    if len(data) != expected:
        raise KVLayoutError(f"KV chunk has {len(data)} bytes, expected {expected} for {num_blocks} blocks")
    return _as_bytes_tensor(data).view(layout.torch_dtype).view(layout.chunk_shape(num_blocks))


def block_bytes_to_tensor(data: bytes, layout: KVLayout) -> torch.Tensor:
    """One block's KV across every layer (as a KV store holds it): (num_layers, *layer_shape)."""
    expected = layout.num_layers * layout.chunk_bytes(1)
    if len(data) != expected:
        raise KVLayoutError(f"KV block has {len(data)} bytes, expected {expected}")
    return _as_bytes_tensor(data).view(layout.torch_dtype).view(layout.num_layers, *layout.layer_shape)


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
        """Layer-major chunks, layer 0 first; a layer larger than `max_bytes` comes in several."""
        per_chunk = self.num_blocks
        if max_bytes is not None:
            per_chunk = max(1, min(self.num_blocks, max_bytes // self.layout.chunk_bytes(1)))
        for layer in range(self.layout.num_layers):
            for first in range(0, self.num_blocks, per_chunk):
                count = min(per_chunk, self.num_blocks - first)
                yield KVChunk(layer, first, count, self._read(layer, first, count))
