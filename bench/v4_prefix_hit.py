"""DeepSeek-V4 prefix cache: time to first token of a hit against a cold run, and bytes a cached block keeps.

A random V4 written by transformers (4 layers: window, CSA, HCA, CSA; V4-Flash's window 128 and ratios 4/128, so
blocks of 128 tokens; hidden 64), in the engine on the CPU. Each round sends a fresh 2,048-token prefix with a
32-token suffix (cold: every token computed), then the same prefix with another suffix (a hit on 16 blocks: only
the suffix computed). Prints one JSON object: medians, their ratio, bytes per cached token (this model and V4-Flash's
shape, against the entries alone and DeepSeek-V3).

    PYTHONPATH=libs:. python bench/v4_prefix_hit.py [--rounds 5] [--prefix 2048] [--suffix 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from engine_core import LLM, SamplingParams
from engine_core.config import ModelConfig
from engine_core.models.deepseek_v4.block_layout import BlockLayout

CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_routed_experts=8,
    sliding_window=128,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=64,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    hc_sinkhorn_iters=4,
    max_position_embeddings=4096,
    partial_rotary_factor=0.25,
    initializer_range=0.1,
)

V4_FLASH = dict(  # the released config's shape, for bytes per token
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    num_hidden_layers=43,
    num_attention_heads=64,
    head_dim=512,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=256,
    num_experts_per_tok=6,
    moe_intermediate_size=2048,
    max_position_embeddings=1048576,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4],
    qk_rope_head_dim=64,
)


def bytes_per_token(model_config: ModelConfig, block_size: int, itemsize: int) -> dict[str, float]:
    """Per cached token: the paged row as allocated (every layer as wide as the widest), the sections alone, and
    the compressed entries alone (what a store keeping no window would hold)."""
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
        "paged_row": len(layouts) * widest * itemsize / block_size,
        "sections": sum(layout.row_width for layout in layouts) * itemsize / block_size,
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
    args = parser.parse_args()
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="v4-prefix-bench-")
    DeepseekV4ForCausalLM(DeepseekV4Config(**CONFIG)).save_pretrained(path)
    llm = LLM(path, device="cpu", block_size=128, max_num_batched_tokens=4096)
    generator = torch.Generator().manual_seed(0)
    ttft(llm, torch.randint(3, 512, (64,), generator=generator).tolist())  # warm-up
    cold, hit, cached = [], [], []
    for _ in range(args.rounds):
        prefix = torch.randint(3, 512, (args.prefix,), generator=generator).tolist()
        suffixes = torch.randint(3, 512, (2, args.suffix), generator=generator).tolist()
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
                "bench_model_bytes_per_token_fp32": bytes_per_token(engine.model_config, 128, 4),
                "v4_flash_bytes_per_token_bf16": bytes_per_token(flash, 128, 2),
                "v3_bytes_per_token_bf16": 61 * (512 + 64) * 2,
            }
        )
    )


if __name__ == "__main__":
    main()
