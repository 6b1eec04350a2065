"""DeepSeek-V4's paged cache as per-layer-type pools, every pool indexed by the same block ids.

The KV cache manager hands out block ids and keeps one block table per request; a block's sections (block_layout)
live in one tensor per pool, each row exactly as wide as its layers' sections:
  window  (L, N, B * D)      every layer: the block's tokens' KV vectors (a hit rebuilds the sliding window from them)
  csa     (Lc, N, Fc)        CSA layers: B/m entries, the overlaps, B/m indexer keys, the indexer's overlaps
  hca     (Lh, N, B/m * D)   HCA layers: B/m entries
A pool exists only when a layer uses it. A block costs `block_bytes` summed over the pools, and no byte is padding
(one tensor as wide as a CSA layer's row for every layer padded window-only and HCA layers: V4-Flash's block of 128
tokens was 7.84 MB, it is 6.73 MB; docs/engine.md).

The runner owns the pools and is their only writer: the model's forward writes a token's sections through
`LayerBlocks` (the views `layer` gives), prefix-cache reads and writes of whole blocks (a KV store's) and
layer-by-layer loads go through `read_block`, `write_block` and `write_layer`. Their bytes are block format 2:
layer by layer, each layer's window row then its kind's row, which is block_layout's section order.

Shapes: L layers (Lc CSA, Lh HCA), N blocks, B tokens per block, D the head size, F a pool row's width, m a ratio.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_core.models.deepseek_v4.block_layout import POOLS, BlockLayout, LayerRows


def pool_shapes(layouts: Sequence[BlockLayout]) -> dict[str, tuple[int, int]]:
    """pool -> (its layers, its row width in elements), for the pools some layer uses, in POOLS order."""
    shapes: dict[str, tuple[int, int]] = {}
    for layout in layouts:
        for pool, width in layout.pool_widths.items():
            num_layers, known = shapes.get(pool, (0, width))
            assert known == width, f"layers of pool {pool} differ in width: {known} and {width}"
            shapes[pool] = (num_layers + 1, width)
    return {pool: shapes[pool] for pool in POOLS if pool in shapes}


def block_bytes(layouts: Sequence[BlockLayout], itemsize: int) -> dict[str, int]:
    """Each pool's bytes per block (all its layers), in a model dtype of `itemsize` bytes: what one block costs
    against kv_cache_memory_bytes is their sum."""
    return {pool: num_layers * width * itemsize for pool, (num_layers, width) in pool_shapes(layouts).items()}


class PagedPools:
    """`num_blocks` blocks of every pool (module docstring), zeroed; the runner owns them."""

    def __init__(
        self, layouts: Sequence[BlockLayout], num_blocks: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layouts = list(layouts)
        self.num_blocks = num_blocks
        self.tensors = {
            pool: torch.zeros((num_layers, num_blocks, width), dtype=dtype, device=device)
            for pool, (num_layers, width) in pool_shapes(layouts).items()
        }
        # per layer: pool -> the layer's index among that pool's layers
        counts = dict.fromkeys(self.tensors, 0)
        self._rows: list[dict[str, int]] = []
        for layout in self.layouts:
            self._rows.append({pool: counts[pool] for pool in layout.pool_widths})
            for pool in layout.pool_widths:
                counts[pool] += 1

    @property
    def num_layers(self) -> int:
        return len(self.layouts)

    @property
    def device(self) -> torch.device:
        return self.tensors["window"].device

    @property
    def bytes_by_pool(self) -> dict[str, int]:
        return {pool: t.numel() * t.element_size() for pool, t in self.tensors.items()}

    @property
    def num_bytes(self) -> int:
        return sum(self.bytes_by_pool.values())

    def layer(self, layer: int) -> LayerRows:
        """Layer `layer`'s rows of the pools it uses: pool -> (N, F), views that write through."""
        return {pool: self.tensors[pool][row] for pool, row in self._rows[layer].items()}

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block, every layer, as block format 2's elements: a new flat CPU tensor."""
        parts = [rows[block_id] for layer in range(self.num_layers) for rows in self.layer(layer).values()]
        return torch.cat(parts).cpu()

    def write_block(self, block_id: int, values: torch.Tensor) -> None:
        """Put one block, every layer (`values`: block format 2's elements, flat), into the pools."""
        offset = 0
        for layer in range(self.num_layers):
            for rows in self.layer(layer).values():
                width = rows.shape[1]
                rows[block_id].copy_(values[offset : offset + width])
                offset += width
        assert offset == values.numel(), f"a block has {offset} elements, got {values.numel()}"

    def write_layer(self, layer: int, block_ids: Sequence[int], values: torch.Tensor) -> None:
        """Put one layer of several blocks into the pools: `values` (len(block_ids), the layer's row_width),
        each row that block's elements of the layer in block format 2."""
        rows_by_pool = self.layer(layer)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        values = values.to(self.device)
        offset = 0
        for rows in rows_by_pool.values():
            width = rows.shape[1]
            rows.index_copy_(0, index, values[:, offset : offset + width])
            offset += width
        assert offset == values.shape[1], f"layer {layer} has {offset} elements a block, got {values.shape[1]}"
