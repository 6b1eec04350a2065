"""DeepSeek-V4 state pools: how kv_cache_memory_bytes splits into state slots and paged blocks, before and after the
pools (issue 21, item 2), and how many sequences of a given context fit at once.

Arithmetic from the shapes alone (deterministic; no weights, no timing). Before the pools, a running request's
entries were held twice (in its state and in its blocks), so each block was charged its row plus the entries a
state gains per block; the pools keep entries only in the blocks, so a block costs its row. Both give at most half
the budget to the fixed per-sequence part (slots = min(max_num_seqs, budget / 2 / slot bytes)). A sequence of
context C needs ceil(C / B) blocks and one slot: concurrent = min(slots, blocks // ceil(C / B)). Prints one JSON
object per (model, budget, context).

    PYTHONPATH=libs:. python bench/v4_pools.py [--budget-gib 40 80] [--context 4096 32768 131072]
"""

from __future__ import annotations

import argparse
import json

from engine_core.config import ModelConfig
from engine_core.models.deepseek_v4.block_layout import BlockLayout, block_size_for
from engine_core.models.deepseek_v4.pools import bytes_per_slot
from engine_core.models.deepseek_v4.shapes import V4_FLASH
from engine_core.tiny_v4 import DEEPSEEK_V4_TINY_CONFIG


def split(config: ModelConfig, itemsize: int, budget: int, max_num_seqs: int, context: int) -> dict[str, object]:
    v4 = config.v4
    assert v4 is not None
    block_size = block_size_for(v4, 16)
    layouts = [BlockLayout.of_layer(v4, i, block_size) for i in range(config.num_layers)]
    row = config.num_layers * max(layout.row_width for layout in layouts) * itemsize  # one block, every layer
    entries = sum(
        rows * width * itemsize
        for layout in layouts
        for name, (_, rows, width) in layout.sections.items()
        if name.endswith("entries")
    )  # what a running state held again per block, before
    slot = sum(bytes_per_slot(v4, itemsize).values())
    slots = min(max_num_seqs, budget // 2 // slot)
    before, after = (budget - slots * slot) // (row + entries), (budget - slots * slot) // row
    per_sequence = -(-context // block_size)
    return {
        "block_size": block_size,
        "slot_bytes": slot,
        "block_bytes": row,
        "slots": slots,
        "blocks_before": before,
        "blocks_after": after,
        "context": context,
        "concurrent_before": min(slots, before // per_sequence),
        "concurrent_after": min(slots, after // per_sequence),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gib", type=float, nargs="+", default=[40, 80])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    models = {
        "V4-Flash bf16": (ModelConfig.from_hf(V4_FLASH), 2),
        "deepseek-v4-tiny fp32": (ModelConfig.from_hf(DEEPSEEK_V4_TINY_CONFIG), 4),
    }
    for name, (config, itemsize) in models.items():
        for gib in args.budget_gib:
            for context in args.context:
                figures = split(config, itemsize, int(gib * 2**30), args.max_num_seqs, context)
                print(json.dumps({"model": name, "budget_gib": gib, **figures}))


if __name__ == "__main__":
    main()
