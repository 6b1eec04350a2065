"""Encoder settings: ServiceSettings plus the models it encodes for, its weights, cache and image limits."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.images import ImageLimits
from engine_core.vision import EMBEDDING_DTYPES
from mesh.config import ServiceSettings, require

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EncoderSettings(ServiceSettings):
    # the language models whose hidden size it projects into; those without a vision_config are skipped
    models: tuple[str, ...] = ("smollm2-135m", "deepseek-tiny")
    device: str = "cpu"
    torch_threads: int = 1  # several roles often share one machine's cores
    encoder_weights: str = ""  # a safetensors file with the vision tower's weights; empty: random from encoder_seed
    encoder_seed: int = 0  # every encoder of a model must compute the same embeddings: same seed or same file
    encoder_cache_bytes: int = 256 * 2**20  # embeddings kept by image hash (LRU)
    embedding_dtype: str = "float32"  # what goes on the wire: float32 | bfloat16 | float16
    max_image_bytes: int = 8 * 2**20
    max_image_side: int = 4096  # pixels, width or height
    max_image_pixels: int = 4096 * 4096

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
