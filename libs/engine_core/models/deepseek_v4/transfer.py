"""A DeepSeek-V4 request's state as KV bytes for a handoff: mesh.kv_blocks.StateSections, one section per layer.

    sections = state_sections(v4)                                          # the layout's description of them
    data = layer_to_bytes(state.layers[i], sections, i, num_tokens, "float32")              # export (prefill)
    state.layers[i] = layer_from_bytes(data, sections, i, num_tokens, "float32", device)    # import (decode)
    block_sections(v4, block_size)        # a block's contents (store, prefix cache): mesh.kv_blocks format 2

A section holds everything the layer's next step reads (the window, the compressors' tails, entries and kept
half-window, the indexer's keys), so a request imported after `num_tokens` tokens decodes exactly as it would have
gone on where it was computed. Section sizes follow from the layout and the token count alone, so a receiver
checks every byte count before it reads.
"""

from __future__ import annotations

import torch

from engine_core.config import V4Config
from engine_core.kv_transfer import (
    BlockSections,
    KVLayoutError,
    Section,
    StateSections,
    named_dtype,
    tensor_to_bytes,
    uint8_view,
)
from engine_core.models.deepseek_v4.block_layout import POOLS, BlockLayout
from engine_core.models.deepseek_v4.state import CompressorState, LayerState


def state_sections(v4: V4Config) -> StateSections:
    return StateSections(
        layer_kinds=v4.attention_types,
        head_dim=v4.head_dim,
        index_head_dim=v4.index_head_dim,
        sliding_window=v4.sliding_window,
        csa_ratio=v4.csa_ratio,
        hca_ratio=v4.hca_ratio,
    )


def block_sections(v4: V4Config, block_size: int) -> BlockSections:
    """Block format 2 for blocks of `block_size` tokens: each layer kind's sections, in `block_layout`'s order. A
    layer's sections lead through the paged pools in that order (its window row, then its kind's row: paged_pools),
    so a layer's bytes in a block are its pool rows back to back, and a stored block holds no padding."""
    kinds: dict[str, tuple[Section, ...]] = {}
    for layer, kind in enumerate(v4.attention_types):
        layout = BlockLayout.of_layer(v4, layer, block_size)
        sections, ends = [], dict.fromkeys(POOLS, 0)
        for name, (offset, rows, width) in layout.sections.items():
            pool = layout.pool_of(name)
            assert offset == ends[pool], f"layer {layer}'s section {name} does not follow the one before it"
            sections.append((name, rows, width))
            ends[pool] += rows * width
        assert kinds.setdefault(kind, tuple(sections)) == tuple(sections), f"layers of kind {kind} differ"
    return BlockSections(tuple(kinds.items()), tuple(v4.attention_types))


def _named_tensors(state: LayerState) -> dict[str, torch.Tensor]:
    """The layer's tensors under their section names (the kept half-window only once it exists)."""
    named = {"window": state.window}
    for prefix, compressor in (("compressor", state.compressor), ("indexer", state.indexer)):
        if compressor is None:
            continue
        parts: dict[str, torch.Tensor | None] = {
            "tail_kv": compressor.tail_kv,
            "tail_gate": compressor.tail_gate,
            "entries": compressor.entries,
            "overlap_kv": compressor.overlap_kv,
            "overlap_gate": compressor.overlap_gate,
        }
        for name, tensor in parts.items():
            if tensor is not None:
                named[f"{prefix}.{name}"] = tensor
    return named


def layer_to_bytes(state: LayerState, sections: StateSections, layer: int, num_tokens: int, dtype: str) -> bytes:
    """One layer's section of a sequence that has computed `num_tokens` tokens."""
    named = _named_tensors(state)
    parts = []
    for name, shape, tensor_dtype in sections.tensors(layer, num_tokens, dtype):
        tensor = named.pop(name, None)
        assert tensor is not None and tuple(tensor.shape) == shape, (
            f"layer {layer}'s {name} is {None if tensor is None else tuple(tensor.shape)}, its section says {shape}"
        )
        parts.append(tensor_to_bytes(tensor.to(named_dtype(tensor_dtype)).cpu()))
    assert not named, f"layer {layer} holds state its section leaves out: {sorted(named)}"
    return b"".join(parts)


def layer_from_bytes(
    data: bytes | bytearray | memoryview,
    sections: StateSections,
    layer: int,
    num_tokens: int,
    dtype: str,
    device: torch.device,
) -> LayerState:
    """The layer's state from its section (copied: `data` may be a receive buffer used again afterwards).
    KVLayoutError when the bytes are not the section's size."""
    expected = sections.layer_bytes(layer, num_tokens, dtype)
    if len(data) != expected:
        raise KVLayoutError(f"layer {layer}'s state section has {len(data)} bytes, expected {expected}")
    raw = uint8_view(data)
    named: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape, tensor_dtype in sections.tensors(layer, num_tokens, dtype):
        torch_dtype = named_dtype(tensor_dtype)
        size = torch_dtype.itemsize
        for dim in shape:
            size *= dim
        named[name] = raw[offset : offset + size].clone().view(torch_dtype).view(shape).to(device)  # fresh, aligned
        offset += size
    return LayerState(named["window"], _compressor(named, "compressor"), _compressor(named, "indexer"))


def _compressor(named: dict[str, torch.Tensor], prefix: str) -> CompressorState | None:
    if f"{prefix}.entries" not in named:
        return None
    return CompressorState(
        named[f"{prefix}.tail_kv"],
        named[f"{prefix}.tail_gate"],
        named[f"{prefix}.entries"],
        named.get(f"{prefix}.overlap_kv"),
        named.get(f"{prefix}.overlap_gate"),
    )
