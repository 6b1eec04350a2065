"""DeepSeek-V4: compressed attention (CSA, HCA) over a sliding window, hyper-connections, hash-routed MoE.

Modules: `attention` (the layer's attention), `compressor` (compressors and the lightning indexer), `blocks`
(hyper-connections, MoE), `state` (what a sequence keeps between steps), `block_layout` (what a block of the paged
cache holds, so a prefix-cache hit resumes exactly), `paged_pools` (the paged cache: one tensor per layer type,
indexed by block id), `pools` (each running sequence's fixed-size state), `model` (the causal LM and its loading).
A later variant (V4.1) is a new module that reuses these pieces and replaces the ones that change.
"""

from engine_core.models.deepseek_v4.model import DeepseekV4ForCausalLM

__all__ = ["DeepseekV4ForCausalLM"]
