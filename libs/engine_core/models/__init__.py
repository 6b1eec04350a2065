"""Model definitions, one module per architecture, chosen by the config's model_type."""

from __future__ import annotations

import torch
from torch import nn

from devices.base import DeviceOps
from engine_core.config import ModelConfig
from engine_core.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine_core.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v4": DeepseekV4ForCausalLM,
}


def build_model(config: ModelConfig, ops: DeviceOps, dtype: torch.dtype) -> nn.Module:
    """An uninitialised model on the device in `dtype` (tensors declared fp32, like the MoE gate, stay fp32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = _ARCHITECTURES[config.model_type](config, ops)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=ops.torch_device)  # allocates every tensor anew, which unties shared ones
    if config.tie_word_embeddings:
        if isinstance(model, DeepseekV4ForCausalLM):
            model.head.weight = model.model.embed.weight
        else:
            model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]
    return model.eval().requires_grad_(False)
