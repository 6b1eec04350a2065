"""The engine every compute role of kvmesh shares: models, paged KV cache, scheduler, sampler, KV export."""

from engine_core.config import ConfigError, EngineConfig, ModelConfig
from engine_core.engine import EngineStats, LLMEngine, PromptError
from engine_core.llm import LLM, GenerationOutput
from engine_core.sampling_params import SamplingParams, SamplingParamsError
from engine_core.scheduler import RequestOutput

__all__ = [
    "LLM",
    "ConfigError",
    "EngineConfig",
    "EngineStats",
    "GenerationOutput",
    "LLMEngine",
    "ModelConfig",
    "PromptError",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
]
