"""DeepSeek-V4 prefix cache: time to first token of a hit against a cold run, and bytes a cached block keeps.

`deepseek-v4-tiny` (4 layers: window, CSA, HCA, CSA; window 32, ratios 4 and 16, so blocks of 16 tokens) in the
engine on the CPU. Each round sends a fresh prefix with a suffix (cold: every token computed), then the same prefix
with another suffix (a hit on the prefix's blocks: only the suffix computed). Prints one JSON object: medians, their
ratio, bytes per cached token (this model, and V4-Flash's shape at blocks of 128, against the entries alone and
DeepSeek-V3).

    PYTHONPATH=libs:. python bench/v4_prefix_hit.py [--rounds 5] [--prefix 2048] [--suffix 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine_core import LLM, SamplingParams
from engine_core.config import ModelConfig
from engine_core.models.deepseek_v4.block_layout import BlockLayout
from engine_core.models.deepseek_v4.paged_pools import block_bytes
from engine_core.models.deepseek_v4.shapes import V4_FLASH


def bytes_per_token(model_config: ModelConfig, block_size: int, itemsize: int) -> dict[str, float]:
    """Per cached token: the paged pools as allocated (exactly the sections: paged_pools), the one tensor they
    replaced (every layer's row as wide as the widest), and the compressed entries alone (what a store keeping no
    window would hold)."""
    v4 = model_config.v4
    assert v4 is not None
    layouts = [BlockLayout.of_layer(v4, i, block_size) for i in range(model_config.num_layers)]
    widest = max(layout.row_width for layout in layouts)
    entries = sum(
        rows * width
        for layout in layouts
        for name, (_, rows, width) in layout.sections.items()
        if name.endswith("entries")
    )
    return {
        "pools": sum(block_bytes(layouts, itemsize).values()) / block_size,
        "one_tensor_before": len(layouts) * widest * itemsize / block_size,
        "entries_only": entries * itemsize / block_size,
    }


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--model", default="deepseek-v4-tiny")
    args = parser.parse_args()
    llm = LLM(args.model, device="cpu", max_num_batched_tokens=4096)
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ttft(llm, torch.randint(3, vocab, (64,), generator=generator).tolist())  # warm-up
    cold, hit, cached = [], [], []
    for _ in range(args.rounds):
        prefix = torch.randint(3, vocab, (args.prefix,), generator=generator).tolist()
        suffixes = torch.randint(3, vocab, (2, args.suffix), generator=generator).tolist()
        seconds, _ = ttft(llm, prefix + suffixes[0])
        cold.append(seconds)
        seconds, num_cached = ttft(llm, prefix + suffixes[1])
        hit.append(seconds)
        cached.append(num_cached)
    engine = llm.engine
    flash = ModelConfig.from_hf(V4_FLASH)
    print(
        json.dumps(
            {
                "prefix_tokens": args.prefix,
                "suffix_tokens": args.suffix,
                "rounds": args.rounds,
                "hit_tokens": cached,
                "cold_ttft_s_median": statistics.median(cold),
                "hit_ttft_s_median": statistics.median(hit),
                "hit_over_cold": statistics.median(hit) / statistics.median(cold),
                "block_size": engine.config.block_size,
                "model_bytes_per_token": bytes_per_token(
                    engine.model_config, engine.config.block_size, engine.dtype.itemsize
                ),
                "v4_flash_bytes_per_token_bf16": bytes_per_token(flash, 128, 2),
                "v3_bytes_per_token_bf16": 61 * (512 + 64) * 2,
            }
        )
    )


if __name__ == "__main__":
    main()
