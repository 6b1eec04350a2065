"""DeepSeek-V4's per-sequence cache as preallocated pools: one slot per running request, one tensor per layer type.

A sequence's cache has a part that grows with its length and a part that does not. The growing part, the
compressed entries (CSA entries and the indexer's keys, HCA entries), lives in the paged blocks (block_layout's
`entries` sections), written as windows close; a step reads them back by the request's block table. The fixed part
lives here, in slot `s` of each pool:
  window                   (L, S, w - 1, D)   every layer: the latest tokens' KV vectors (the sliding window)
  csa.tail_kv, .tail_gate  (Lc, S, m - 1, 2D) CSA: the open window's projections (two series), model dtype
  csa.overlap_kv           (Lc, S, m, D)      CSA: the last closed window's first series ...
  csa.overlap_gate         (Lc, S, m, D)      ... and its gate logits, position bias added (fp32)
  csa.index_*              the same four for the lightning indexer, D -> Di
  hca.tail_kv, .tail_gate  (Lh, S, m - 1, D)  HCA: the open window (one series)
How much of a slot is in use follows from the sequence's token count n alone: min(n, w - 1) window rows, n mod m
tail rows, the overlap once n >= m, n // m entries. So a slot needs no clearing between requests, and `load` /
`store` give the model's `LayerState`s (attention and compressors are written against them) as views of the slot
and write them back after the step.

The slots are handed out by the KV cache manager (one per request holding blocks); `bytes_per_slot` is what the
engine counts per slot against kv_cache_memory_bytes, and equals state.bytes_per_sequence summed over the layers.

Shapes: L layers (Lc CSA, Lh HCA), S slots, w the sliding window, D the head size, Di the indexer's, m a ratio.
"""

from __future__ import annotations

import torch

from engine_core.config import V4Config
from engine_core.models.deepseek_v4.state import CompressorState, LayerState


def _pool_shapes(v4: V4Config) -> dict[str, tuple[int, tuple[int, ...], bool]]:
    """name -> (layers of the pool, one slot's shape, whether it is fp32 rather than the model's dtype)."""
    kinds = v4.attention_types
    num_csa, num_hca = kinds.count("csa"), kinds.count("hca")
    d, di, w = v4.head_dim, v4.index_head_dim, v4.sliding_window
    shapes: dict[str, tuple[int, tuple[int, ...], bool]] = {"window": (len(kinds), (w - 1, d), False)}
    if num_csa:
        m = v4.csa_ratio
        for prefix, width in (("", d), ("index_", di)):
            shapes[f"csa.{prefix}tail_kv"] = (num_csa, (m - 1, 2 * width), False)
            shapes[f"csa.{prefix}tail_gate"] = (num_csa, (m - 1, 2 * width), False)
            shapes[f"csa.{prefix}overlap_kv"] = (num_csa, (m, width), False)
            shapes[f"csa.{prefix}overlap_gate"] = (num_csa, (m, width), True)
    if num_hca:
        m = v4.hca_ratio
        shapes["hca.tail_kv"] = (num_hca, (m - 1, d), False)
        shapes["hca.tail_gate"] = (num_hca, (m - 1, d), False)
    return shapes


def bytes_per_slot(v4: V4Config, itemsize: int) -> dict[str, int]:
    """Each pool's bytes per slot (all its layers), in a model dtype of `itemsize` bytes."""
    out = {}
    for name, (num_layers, shape, is_fp32) in _pool_shapes(v4).items():
        out[name] = num_layers * (4 if is_fp32 else itemsize) * int(torch.Size(shape).numel())
    return out


class StatePools:
    """The fixed part of `num_slots` sequences' caches (module docstring). The runner owns it; the model reads
    and writes slots through `load` and `store` only."""

    def __init__(self, v4: V4Config, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.v4, self.num_slots = v4, num_slots
        self.tensors = {
            name: torch.zeros((num_layers, num_slots, *shape), dtype=torch.float32 if is_fp32 else dtype, device=device)
            for name, (num_layers, shape, is_fp32) in _pool_shapes(v4).items()
        }
        # a layer's row in its type's pools: its index among the layers of its type
        counts: dict[str, int] = {}
        self.row: list[int] = []
        for kind in v4.attention_types:
            self.row.append(counts.get(kind, 0))
            counts[kind] = counts.get(kind, 0) + 1

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _slot(self, name: str, layer: int, slot: int) -> torch.Tensor:
        pool = self.tensors[name]
        return pool[layer if name == "window" else self.row[layer], slot]

    def load(self, slot: int, layer: int, num_tokens: int, entries: dict[str, torch.Tensor]) -> LayerState:
        """Layer `layer`'s state of the sequence in `slot` after `num_tokens` tokens: views of the slot (sliced to
        what is in use) and the given entries (`entries`, `index_entries`: read from the blocks by the caller)."""
        kind = self.v4.attention_types[layer]
        window = self._slot("window", layer, slot)[: min(num_tokens, self.v4.sliding_window - 1)]
        if kind == "window":
            return LayerState(window)
        if kind == "hca":
            return LayerState(window, self._compressor("hca.", "", layer, slot, num_tokens, entries["entries"]))
        compressor = self._compressor("csa.", "", layer, slot, num_tokens, entries["entries"])
        indexer = self._compressor("csa.", "index_", layer, slot, num_tokens, entries["index_entries"])
        return LayerState(window, compressor, indexer)

    def _compressor(
        self, pool: str, prefix: str, layer: int, slot: int, num_tokens: int, entries: torch.Tensor
    ) -> CompressorState:
        ratio = self.v4.csa_ratio if pool == "csa." else self.v4.hca_ratio
        tail = num_tokens % ratio
        state = CompressorState(
            self._slot(f"{pool}{prefix}tail_kv", layer, slot)[:tail],
            self._slot(f"{pool}{prefix}tail_gate", layer, slot)[:tail],
            entries,
        )
        if pool == "csa." and num_tokens >= ratio:  # a window has closed: its first series is kept
            state.overlap_kv = self._slot(f"{pool}{prefix}overlap_kv", layer, slot)
            state.overlap_gate = self._slot(f"{pool}{prefix}overlap_gate", layer, slot)
        return state

    def store(self, slot: int, layer: int, state: LayerState) -> None:
        """Write a layer's window, tails and overlaps into `slot` (not its entries: those live in the blocks).
        Values are copied in their own dtype (a state never holds another: a mismatch is a bug, not a cast)."""
        kind = self.v4.attention_types[layer]
        self._put("window", layer, slot, state.window)
        parts = [] if kind == "window" else [(state.compressor, "")]
        if kind == "csa":
            parts.append((state.indexer, "index_"))
        for compressor, prefix in parts:
            assert compressor is not None
            self._put(f"{kind}.{prefix}tail_kv", layer, slot, compressor.tail_kv)
            self._put(f"{kind}.{prefix}tail_gate", layer, slot, compressor.tail_gate)
            if compressor.overlap_kv is not None and compressor.overlap_gate is not None:
                self._put(f"{kind}.{prefix}overlap_kv", layer, slot, compressor.overlap_kv)
                self._put(f"{kind}.{prefix}overlap_gate", layer, slot, compressor.overlap_gate)

    def _put(self, name: str, layer: int, slot: int, value: torch.Tensor) -> None:
        target = self._slot(name, layer, slot)
        assert value.dtype == target.dtype, f"{name} of layer {layer} is {value.dtype}, its pool {target.dtype}"
        rows = value.shape[0]
        if rows and target[:rows].data_ptr() != value.data_ptr():  # a view of the slot already is the slot
            target[:rows].copy_(value)
