"""The encoder role's core: an image's bytes -> its embeddings in a language model's hidden size, cached by hash.

One image, in order:
  1. its key: (model, SHA-256 of its bytes); a cache hit returns the embeddings at once;
  2. otherwise it is decoded (Pillow: PNG or JPEG within the limits, else ImageError) and run through the model's
     vision transformer on the encode thread (one at a time: torch parallelizes inside), and cached.
The cache is an LRU bounded by bytes. Only this object writes it, on the event loop; the encode thread reads
nothing shared but the (immutable after load) encoders.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_core import model_store
from engine_core.images import ImageLimits, decode_image, image_hash
from engine_core.loader import hf
from engine_core.vision import EMBEDDING_DTYPES, VisionConfig, VisionEncoder, encode_images, load_encoder
from mesh.logging import get_logger
from mesh.rpc import UnknownModelError

log = get_logger(__name__)
CacheKey = tuple[str, bytes]  # (model, image hash)


@dataclass(frozen=True)
class EncodedImage:
    image_hash: bytes
    embeddings: torch.Tensor  # (num_tokens, hidden_size) on the CPU
    is_cached: bool  # served from the cache
    seconds: float  # decode + encode time (0 for a cache hit)


@dataclass(frozen=True)
class CacheStats:
    num_entries: int
    num_bytes: int
    num_hits: int
    num_misses: int


class EmbeddingCache:
    """Embeddings by key, least recently used evicted first, at most `capacity_bytes` in all."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[CacheKey, torch.Tensor] = OrderedDict()
        self._num_bytes = 0
        self._num_hits = 0
        self._num_misses = 0

    def get(self, key: CacheKey) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is None:
            self._num_misses += 1
            return None
        self._num_hits += 1
        self._entries.move_to_end(key)
        return found

    def put(self, key: CacheKey, embeddings: torch.Tensor) -> None:
        size = _num_bytes(embeddings)
        if key in self._entries or size > self.capacity_bytes:
            return
        while self._num_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._num_bytes -= _num_bytes(evicted)
        self._entries[key] = embeddings
        self._num_bytes += size

    def stats(self) -> CacheStats:
        return CacheStats(len(self._entries), self._num_bytes, self._num_hits, self._num_misses)


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ImageEncoder:
    def __init__(
        self, encoders: Mapping[str, VisionEncoder], limits: ImageLimits, cache_bytes: int, dtype: str = "float32"
    ) -> None:
        self.encoders = dict(encoders)  # model -> its vision tower; read-only after construction
        self.limits = limits
        self.dtype = EMBEDDING_DTYPES[dtype]
        self.cache = EmbeddingCache(cache_bytes)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")

    @property
    def models(self) -> list[str]:
        return sorted(self.encoders)

    def num_image_tokens(self, model: str) -> int:
        return self._encoder(model).config.num_image_tokens

    async def encode(self, model: str, data: bytes) -> EncodedImage:
        """Raises UnknownModelError, ImageError (a ValueError naming the problem with the image)."""
        encoder = self._encoder(model)
        key = (model, image_hash(data))
        cached = self.cache.get(key)
        if cached is not None:
            return EncodedImage(key[1], cached, True, 0.0)
        started = time.monotonic()
        embeddings = await asyncio.get_running_loop().run_in_executor(self._executor, self._compute, encoder, data)
        self.cache.put(key, embeddings)
        return EncodedImage(key[1], embeddings, False, time.monotonic() - started)

    def _compute(self, encoder: VisionEncoder, data: bytes) -> torch.Tensor:
        """On the encode thread."""
        image = decode_image(data, self.limits)
        return encode_images(encoder, [image])[0].to(self.dtype)

    def _encoder(self, model: str) -> VisionEncoder:
        encoder = self.encoders.get(model)
        if encoder is None:
            served = ", ".join(self.models) or "none"
            raise UnknownModelError(f"this encoder does not encode images for {model!r} (it does for: {served})")
        return encoder

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def vision_config_of(model: str) -> VisionConfig | None:
    """The vision tower a model takes images through (its config.json's vision_config); None if it takes none."""
    path = model_store.resolve(model)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None  # a GGUF file: no vision tower
    return VisionConfig.from_model_config(hf.read_config(path))


def load_encoders(models: tuple[str, ...], weights: str, seed: int, device: str) -> dict[str, VisionEncoder]:
    """A vision tower for each of `models` that takes images; the others are skipped (and logged)."""
    encoders = {}
    for model in models:
        config = vision_config_of(model)
        if config is None:
            log.info("model takes no images; not encoding for it", model=model)
            continue
        encoders[model] = load_encoder(config, Path(weights) if weights else None, seed, device)
        log.info(
            "vision encoder ready",
            model=model,
            num_image_tokens=config.num_image_tokens,
            weights=weights or f"random (seed {seed})",
        )
    if not encoders:
        log.warning("none of the models takes images: this encoder serves none", models=list(models))
    return encoders
