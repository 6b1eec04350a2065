"""What one block of the paged cache holds for DeepSeek-V4, so a prefix-cache hit resumes exactly.

A block covers `block_size` tokens, a multiple of every compress ratio in use, so at a block boundary every
compressor's open window is empty: the state a sequence has there is fully given by its blocks. Per layer, a block
holds (flat, the model's dtype), in this order:
  window       (B, D)  every token's KV vector (rotated): the last blocks rebuild the sliding window
  entries      (B/m, D)  the compressor's entries whose windows lie in the block (CSA, HCA)
  overlap_kv   (m, D)  CSA: the block's last window's first series, projected ...
  overlap_gate (m, D)  ... and its raw gate logits (the position bias is added back on reading, in fp32)
  index_*      the same three for the lightning indexer's narrower keys (CSA)
The sections live in per-layer-type pools (`paged_pools`), all indexed by the same block ids: `window` (every
layer's window section), `csa` (a CSA layer's other sections, in order) and `hca` (an HCA layer's entries). So each
pool's row is exactly as wide as its layers' sections (no padding), and a layer's sections in this order are its
window row followed by its kind's row: block format 2 (`transfer.block_sections`).

The model writes a token's sections in the step that computes it (`LayerBlocks`), so a full block is complete when
the block manager caches it; `read_layer_state` rebuilds a layer's state after the first k blocks.

Shapes: N blocks in the pool, F a pool row's width, T the step's rows, W a compressor's width, m its ratio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine_core.config import V4Config

POOLS = ("window", "csa", "hca")  # the paged pools, in the order a layer's sections lead through them
LayerRows = Mapping[str, torch.Tensor]  # one layer's rows of the pools it uses: pool -> (N, F), views


@dataclass(frozen=True)
class BlockLayout:
    """Where each section of one layer's block sits: name -> (offset in its pool's row, rows, width). The window
    section is in the `window` pool, the others in the pool of the layer's kind."""

    block_size: int
    kind: str  # window | csa | hca
    ratio: int  # the layer's compress ratio; 0 on window-only layers
    sections: dict[str, tuple[int, int, int]]  # in block format 2's order

    @classmethod
    def of_layer(cls, v4: V4Config, layer: int, block_size: int) -> BlockLayout:
        kind, ratio, d = v4.attention_types[layer], v4.compress_ratio(layer), v4.head_dim
        shapes = [("window", block_size, d)]
        if ratio:
            shapes.append(("entries", block_size // ratio, d))
        if kind == "csa":
            di = v4.index_head_dim
            shapes += [("overlap_kv", ratio, d), ("overlap_gate", ratio, d)]
            shapes += [("index_entries", block_size // ratio, di), ("index_overlap_kv", ratio, di)]
            shapes.append(("index_overlap_gate", ratio, di))
        sections, offsets = {}, dict.fromkeys(POOLS, 0)
        for name, rows, width in shapes:
            pool = "window" if name == "window" else kind
            sections[name] = (offsets[pool], rows, width)
            offsets[pool] += rows * width
        return cls(block_size, kind, ratio, sections)

    def pool_of(self, name: str) -> str:
        return "window" if name == "window" else self.kind

    @property
    def pool_widths(self) -> dict[str, int]:
        """Elements of this layer's row in each pool it uses, in POOLS order."""
        widths: dict[str, int] = {}
        for name, (_, rows, width) in self.sections.items():
            pool = self.pool_of(name)
            widths[pool] = widths.get(pool, 0) + rows * width
        return widths

    @property
    def row_width(self) -> int:
        """Elements of this layer in one block, every pool: its block format 2 size."""
        return sum(self.pool_widths.values())

    def view(self, rows: LayerRows, name: str) -> torch.Tensor:
        """One section of every block: the layer's row of the section's pool (N, F) -> a view (N, rows, width)
        that writes through."""
        offset, num_rows, width = self.sections[name]
        cache = rows[self.pool_of(name)]
        return cache[:, offset : offset + num_rows * width].view(cache.shape[0], num_rows, width)


def block_size_for(v4: V4Config, requested: int) -> int:
    """The smallest multiple of every compress ratio in use that is at least `requested` tokens."""
    step = math.lcm(*(v4.compress_ratio(layer) or 1 for layer in range(len(v4.attention_types))))
    return -(-requested // step) * step


class LayerBlocks:
    """One layer's block rows for one step: writes each computed token's sections into the block it falls in.
    `slots` (T,): each row's flat slot (block id * B + offset), as the runner computed them."""

    def __init__(self, cache: LayerRows, layout: BlockLayout, slots: torch.Tensor) -> None:
        self.cache, self.layout = cache, layout
        self.blocks, self.offsets = slots // layout.block_size, slots % layout.block_size  # (T,), (T,)

    def write_window(self, kv: torch.Tensor) -> None:
        """kv (T, D): every row's KV vector."""
        window = self.layout.view(self.cache, "window")
        window[self.blocks, self.offsets] = kv.to(window.dtype)

    def write_overlap(self, prefix: str, rows: slice, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """A CSA compressor's projections kv, gate (L, 2W) of one sequence's rows: the first series of the rows in
        their block's last window (the half the next block's first entry mixes)."""
        m, size = self.layout.ratio, self.layout.block_size
        offsets, blocks = self.offsets[rows], self.blocks[rows]
        keep = offsets >= size - m  # (L,)
        if not bool(keep.any()):
            return
        width = self.layout.sections[prefix + "overlap_kv"][2]
        at = (blocks[keep], offsets[keep] - (size - m))
        overlap_kv, overlap_gate = (
            self.layout.view(self.cache, prefix + name) for name in ("overlap_kv", "overlap_gate")
        )
        overlap_kv[at] = kv[keep, :width].to(overlap_kv.dtype)
        overlap_gate[at] = gate[keep, :width].to(overlap_gate.dtype)

    def write_entries(self, prefix: str, rows: slice, first_position: int, entries: torch.Tensor, first: int) -> None:
        """Entries [first, first + n) of one sequence (entries (n, W)), emitted this step: entry e's window closes
        at position (e + 1) m - 1, one of the sequence's rows (`rows`, starting at `first_position`)."""
        n, m = entries.shape[0], self.layout.ratio
        if n == 0:
            return
        last = torch.arange(first + 1, first + n + 1, device=entries.device) * m - 1  # (n,) closing positions
        at = rows.start + last - first_position
        index = (self.blocks[at], (last % self.layout.block_size) // m)
        section = self.layout.view(self.cache, prefix + "entries")
        section[index] = entries.to(section.dtype)


def read_layer_state(
    cache: LayerRows, layout: BlockLayout, block_ids: torch.Tensor, window: int
) -> dict[str, torch.Tensor]:
    """A layer's state after the tokens of blocks `block_ids` (k,): the last `window` tokens' KV (or all of them),
    every entry, and the last block's overlap sections. New tensors, not views of the cache."""
    size = layout.block_size
    num_tokens = block_ids.shape[0] * size
    num_window_blocks = -(-window // size)  # blocks that hold the last `window` tokens
    last_blocks = block_ids[-num_window_blocks:]
    kv = layout.view(cache, "window")[last_blocks].flatten(0, 1)  # (tokens of those blocks, D)
    out = {"window": kv[max(0, kv.shape[0] - min(window, num_tokens)) :].clone()}
    for name in layout.sections:
        if name.endswith("entries"):
            out[name] = layout.view(cache, name)[block_ids].flatten(0, 1)  # (k B / m, W)
        elif "overlap" in name:
            out[name] = layout.view(cache, name)[block_ids[-1]].clone()  # (m, W)
    return out


def read_entries(
    cache: LayerRows, layout: BlockLayout, block_ids: torch.Tensor, num_tokens: int
) -> dict[str, torch.Tensor]:
    """The entries (CSA: and the indexer's keys) of a sequence after `num_tokens` tokens, from its blocks
    `block_ids` (at least those holding the tokens): name -> (num_tokens // m, W), new tensors. Empty for a
    window-only layer."""
    if not layout.ratio:
        return {}
    num_blocks = -(-num_tokens // layout.block_size)
    index = block_ids[:num_blocks]
    count = num_tokens // layout.ratio
    return {
        name: layout.view(cache, name)[index].flatten(0, 1)[:count]
        for name in layout.sections
        if name.endswith("entries")
    }


def write_entries(
    cache: LayerRows, layout: BlockLayout, block_ids: torch.Tensor, name: str, entries: torch.Tensor
) -> None:
    """Put a sequence's entries (E, W) (from its first) into section `name` of its blocks `block_ids`, where the
    model's forward would have written them (a state that arrived whole: a KV import)."""
    if entries.shape[0] == 0:
        return
    section = layout.view(cache, name)
    first = torch.arange(entries.shape[0], device=section.device) * layout.ratio  # each entry's first token
    at = (block_ids[first // layout.block_size], (first % layout.block_size) // layout.ratio)
    section[at] = entries.to(section.dtype)
