"""Building blocks shared by the model definitions, and the causal-LM skeleton both architectures fill in."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from devices.base import DeviceOps
from engine_core.config import ModelConfig
from engine_core.models.batch import ForwardBatch
from engine_core.models.loading import Target, load_weights
from engine_core.models.rope import RotaryEmbedding

CosSin = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: DeviceOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: DeviceOps) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, ops: DeviceOps, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, rope: RotaryEmbedding, cache: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, rope, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: DeviceOps, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class CausalLM(nn.Module):
    """embed -> decoder layers (each over its layer of the paged cache) -> norm -> LM head.

    Subclasses build the layers and the rope, and say how checkpoint names map to parameters (`_target`) and
    how a layer's KV cache is shaped (`kv_cache_shape`, `kv_block_axis`). Parameter names follow Hugging Face's.
    """

    kv_block_axis: int  # the block dimension of kv_cache_shape

    def __init__(self, config: ModelConfig, ops: DeviceOps, layers: Iterable[nn.Module], rope: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, ops, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = rope

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        raise TypeError(f"{type(self).__name__} must define kv_cache_shape")

    def _target(self, name: str) -> Target:
        raise TypeError(f"{type(self).__name__} must define _target")

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> final hidden states (T, Hd)."""
        x = self.model.embed_tokens(input_ids)  # (T, Hd)
        if batch.embed_rows is not None and batch.embed_values is not None:
            x = x.index_copy(0, batch.embed_rows, batch.embed_values.to(x.dtype))
        cos_sin = self.rope.rotation(batch.positions)  # once per step, for every layer
        for index, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            if batch.wait_for_layer is not None:
                batch.wait_for_layer(index)  # KV loaded from elsewhere: this layer's has arrived
            x = layer(x, cos_sin, self.rope, cache, batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, self._target)

    def _skips(self, name: str) -> bool:
        """Checkpoint tensors no serving model uses."""
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings)
