"""Llama (grouped-query attention, SwiGLU MLP, RMSNorm, RoPE); covers SmolLM2.

Shapes: T tokens in the flattened batch, Hd hidden size, H query heads, K kv heads, D head size.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from devices.base import DeviceOps
from engine_core.config import ModelConfig
from engine_core.models.batch import ForwardBatch, write_cache
from engine_core.models.layers import CausalLM, CosSin, DecoderLayer, GatedMLP
from engine_core.models.loading import Target
from engine_core.models.rope import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: DeviceOps) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.split = (q_size, kv_size, kv_size)
        self.scale = self.head_dim**-0.5
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: CosSin,
        rope: RotaryEmbedding,
        cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        num_tokens, num_heads, num_kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # (T, (H + 2K) * D)
        q_size, kv_size, _ = self.split
        # q and k side by side in each row: one rope call rotates both
        qk = qkv[:, : q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, self.head_dim)  # (T, H + K, D)
        q, k = rope(qk, *cos_sin).split([num_heads, num_kv_heads], dim=1)  # (T, H, D), (T, K, D)
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, self.head_dim)  # (T, K, D)
        k_cache, v_cache = cache[0], cache[1]  # (N, S, K, D) each
        write_cache(k_cache, batch.slot_mapping, k)
        write_cache(v_cache, batch.slot_mapping, v)
        num_decode = batch.num_decode_tokens
        if num_decode == num_tokens:  # decodes only: their attention is the whole output, no copy into one
            assert batch.decode is not None
            out = self.ops.paged_decode_attention(q, k_cache, v_cache, batch.decode, self.scale)
            return self.o_proj(out.reshape(num_tokens, -1))
        out = q.new_empty(num_tokens, num_heads, self.head_dim)  # (T, H, D)
        if num_decode:
            assert batch.decode is not None
            out[:num_decode] = self.ops.paged_decode_attention(
                q[:num_decode], k_cache, v_cache, batch.decode, self.scale
            )
        for seg in batch.prefills:
            rows = slice(seg.start, seg.end)
            if seg.num_cached == 0:  # the whole context is this segment: use the fresh k, v
                out[rows] = self.ops.prefill_attention(q[rows], k[rows], v[rows], 0, self.scale)
            else:
                out[rows] = self.ops.cached_prefill_attention(
                    q[rows], k_cache, v_cache, seg.block_ids, seg.num_cached, self.scale
                )
        return self.o_proj(out.view(num_tokens, -1))


class LlamaForCausalLM(CausalLM):
    kv_block_axis = 1

    def __init__(self, config: ModelConfig, ops: DeviceOps) -> None:
        layers = (
            DecoderLayer(
                config, ops, LlamaAttention(config, ops), GatedMLP(config.hidden_size, config.intermediate_size, ops)
            )
            for _ in range(config.num_layers)
        )
        rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings, interleaved=False
        )
        super().__init__(config, ops, layers, rope)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Per layer: keys and values, (2, N, S, K, D)."""
        return (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)

    def _target(self, name: str) -> Target:
        if self._skips(name):
            return None
        cfg = self.config
        q_size, kv_size, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        fused = {
            "q_proj": ("qkv_proj", slice(0, q_size)),
            "k_proj": ("qkv_proj", slice(q_size, q_size + kv_size)),
            "v_proj": ("qkv_proj", slice(q_size + kv_size, q_size + 2 * kv_size)),
            "gate_proj": ("gate_up_proj", slice(0, inter)),
            "up_proj": ("gate_up_proj", slice(inter, 2 * inter)),
        }
        match = re.fullmatch(
            r"(model\.layers\.\d+\.\w+)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)", name
        )
        if match:
            fused_name, rows = fused[match.group(2)]
            return f"{match.group(1)}.{fused_name}.{match.group(3)}", rows
        return name, None
