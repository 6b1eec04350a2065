"""DeepSeek-V4's pools: how kv_cache_memory_bytes splits into state slots and paged blocks, what a block costs, and
how many sequences of a given context fit at once, at three stages of issue 21's item 2:
  entries_twice  one paged tensor (every layer's row as wide as a CSA layer's), and a running state held its
                 entries again (each block charged its row plus the entries a state gains per block)
  one_tensor     the state pools (entries only in the blocks), the paged cache still one tensor of CSA-wide rows
  pools          the paged cache as per-layer-type pools (window, csa, hca): a block costs the sum of the pools'
                 rows, exactly its sections (paged_pools.block_bytes)

Arithmetic from the shapes alone (deterministic; no weights, no timing). Every stage gives at most half the budget to
the fixed per-sequence part (slots = min(max_num_seqs, budget / 2 / slot bytes)). A sequence of context C needs
ceil(C / B) blocks and one slot: concurrent = min(slots, blocks // ceil(C / B)). Prints one JSON object per
(model, budget, context).

    PYTHONPATH=libs:. python bench/v4_pools.py [--budget-gib 40 80] [--context 4096 32768 131072]
"""

from __future__ import annotations

import argparse
import json

from engine_core.config import ModelConfig
from engine_core.models.deepseek_v4.block_layout import BlockLayout, block_size_for
from engine_core.models.deepseek_v4.paged_pools import block_bytes
from engine_core.models.deepseek_v4.pools import bytes_per_slot
from engine_core.models.deepseek_v4.shapes import V4_FLASH
from engine_core.tiny_v4 import DEEPSEEK_V4_TINY_CONFIG


def block_costs(config: ModelConfig, block_size: int, itemsize: int) -> dict[str, object]:
    """Bytes per block, every layer: by pool, and at each stage (module docstring)."""
    v4 = config.v4
    assert v4 is not None
    layouts = [BlockLayout.of_layer(v4, i, block_size) for i in range(config.num_layers)]
    one_tensor = config.num_layers * max(layout.row_width for layout in layouts) * itemsize
    entries = sum(
        rows * width * itemsize
        for layout in layouts
        for name, (_, rows, width) in layout.sections.items()
        if name.endswith("entries")
    )  # what a running state held again per block, before the state pools
    by_pool = block_bytes(layouts, itemsize)
    stages = {"entries_twice": one_tensor + entries, "one_tensor": one_tensor, "pools": sum(by_pool.values())}
    return {"by_pool": by_pool, "stages": stages}


def split(config: ModelConfig, itemsize: int, budget: int, max_num_seqs: int, context: int) -> dict[str, object]:
    v4 = config.v4
    assert v4 is not None
    block_size = block_size_for(v4, 16)
    costs = block_costs(config, block_size, itemsize)
    stages: dict[str, int] = costs["stages"]  # type: ignore[assignment]
    slot = sum(bytes_per_slot(v4, itemsize).values())
    slots = min(max_num_seqs, budget // 2 // slot)
    blocks = {stage: (budget - slots * slot) // cost for stage, cost in stages.items()}
    per_sequence = -(-context // block_size)
    return {
        "block_size": block_size,
        "slot_bytes": slot,
        "slots": slots,
        "block_bytes_by_pool": costs["by_pool"],
        "block_bytes": stages,
        "blocks": blocks,
        "context": context,
        "concurrent": {stage: min(slots, count // per_sequence) for stage, count in blocks.items()},
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
