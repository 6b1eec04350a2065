"""The released DeepSeek-V4 checkpoints' shapes, as config.json fields (DeepSeek's legacy names), for what can be
computed without their weights: KV bytes per token and per sequence, block row widths, memory budgets."""

from __future__ import annotations

from typing import Any

# V4-Flash: 2 window-only, 21 CSA and 20 HCA layers, 256 routed experts.
V4_FLASH: dict[str, Any] = dict(
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
