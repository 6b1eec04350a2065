"""Encoder settings: ServiceSettings plus the models it encodes for, its weights, cache and image limits."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core import model_store
from engine_core.images import ImageLimits
from engine_core.vision import EMBEDDING_DTYPES
from mesh.config import ServiceSettings, require, setting

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EncoderSettings(ServiceSettings):
    models: tuple[str, ...] = setting(
        model_store.DEFAULT_MODELS,
        "the language models whose hidden size it projects into (those without a vision_config are skipped)",
    )
    device: str = setting("cpu", "cpu or cuda")
    torch_threads: int = setting(1, "CPU threads per worker (several roles often share one machine's cores)")
    encoder_weights: str = setting(
        "", "a safetensors file with the vision tower's weights (empty: random from KVMESH_ENCODER_SEED)"
    )
    encoder_seed: int = setting(
        0, "the random weights' seed: every encoder of a model must compute the same embeddings (same seed or file)"
    )
    encoder_cache_bytes: int = setting(256 * 2**20, "embeddings kept by image hash (LRU)")
    embedding_dtype: str = setting("float32", "embeddings on the wire: float32, bfloat16 or float16")
    max_image_bytes: int = setting(8 * 2**20, "an image's bytes; more is refused naming it")
    max_image_side: int = setting(
        4096, "an image's width or height in pixels; more is refused naming it (at the gateway: a 400)"
    )
    max_image_pixels: int = setting(
        4096 * 4096, "an image's width x height; more is refused naming it (at the gateway: a 400)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.models) > 0, "models", self.models, "must name at least one model")
        require(self.device in DEVICES, "device", self.device, f"must be one of {', '.join(DEVICES)}")
        require(
            self.embedding_dtype in EMBEDDING_DTYPES,
            "embedding_dtype",
            self.embedding_dtype,
            f"must be one of {', '.join(EMBEDDING_DTYPES)}",
        )
        for name in ("torch_threads", "encoder_cache_bytes", "max_image_bytes", "max_image_side", "max_image_pixels"):
            value = getattr(self, name)
            require(value > 0, name, value, "must be positive")

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_image_bytes, self.max_image_side, self.max_image_pixels)
