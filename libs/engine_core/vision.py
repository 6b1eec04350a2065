"""A small vision transformer and the projector into a language model's hidden size (LLaVA's recipe).

    pixels (N, 3, S, S) -> patch embedding (N, L, Hv), L = (S / P)^2 -> + positions -> transformer blocks
    -> norm -> optional p x p average pooling (L / p^2 tokens) -> projector MLP -> (N, T, D)

A model accepts images when its config.json has a `vision_config` (this module's sizes) and an `image_token_id`
(the placeholder token: the gateway writes T of them per image, and prefill puts the T embeddings there).
Weights are random from a fixed seed by default (the same bytes on every machine, like deepseek-tiny's), or
read from a safetensors file with the names `VisionEncoder.state_dict()` uses.

Shapes: N images, S image side, P patch side, L patches, Hv vision width, T image tokens, D the LM's hidden size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn

from engine_core.config import ConfigError

SEED = 0


@dataclass(frozen=True)
class VisionConfig:
    text_hidden_size: int  # D: the language model's hidden size, the projector's output
    image_size: int = 128  # images are resized to S x S
    patch_size: int = 16
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    pool: int = 1  # average p x p neighbouring patches into one token
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"vision_config.{f.name} must be a positive number, got {value!r}")
        if self.image_size % self.patch_size or self.num_patches_per_side % self.pool:
            raise ConfigError(
                f"vision_config: image_size {self.image_size} must be a multiple of patch_size "
                f"{self.patch_size}, and the patches per side a multiple of pool {self.pool}"
            )
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"vision_config: hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )

    @property
    def num_patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_image_tokens(self) -> int:
        """T: the placeholder tokens one image fills."""
        return (self.num_patches_per_side // self.pool) ** 2

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "text_hidden_size"}

    @classmethod
    def from_model_config(cls, raw: dict[str, Any]) -> VisionConfig | None:
        """The vision tower of a model's config.json; None for a model that takes no images."""
        vision = raw.get("vision_config")
        if vision is None:
            return None
        known = {f.name for f in fields(cls)} - {"text_hidden_size"}
        if not isinstance(vision, dict) or set(vision) - known:
            raise ConfigError(f"malformed vision_config: expected an object with keys among {', '.join(sorted(known))}")
        return cls(text_hidden_size=int(raw["hidden_size"]), **vision)


def image_token_id(raw: dict[str, Any]) -> int | None:
    """The placeholder token of a model that takes images (config.json `image_token_id`), else None."""
    if raw.get("vision_config") is None:
        return None
    token_id = raw.get("image_token_id")
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        raise ConfigError(f"a model with a vision_config needs an image_token_id, got {token_id!r}")
    return token_id


class VisionBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)); attention over all patches (no mask)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(hidden, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, hidden = x.shape  # (N, L, Hv)
        qkv = self.qkv(self.norm1(x)).view(n, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # (3, N, h, L, hs)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (N, h, L, hs)
        x = x + self.proj(attn.transpose(1, 2).reshape(n, length, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        hidden, side = config.hidden_size, config.num_patches_per_side
        self.patch_embed = nn.Conv2d(3, hidden, kernel_size=config.patch_size, stride=config.patch_size)
        self.position_embedding = nn.Parameter(torch.zeros(side * side, hidden))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.post_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.projector = nn.Sequential(
            nn.Linear(hidden, config.text_hidden_size),
            nn.GELU(),
            nn.Linear(config.text_hidden_size, config.text_hidden_size),
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (N, 3, S, S) in [-1, 1] -> image embeddings (N, T, D), in row-major patch order."""
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)  # (N, L, Hv)
        x = x + self.position_embedding
        for block in self.blocks:
            x = block(x)
        x = self.post_norm(x)
        pool = self.config.pool
        if pool > 1:
            n, side = x.shape[0], self.config.num_patches_per_side
            grid = x.transpose(1, 2).reshape(n, -1, side, side)  # (N, Hv, side, side)
            x = F.avg_pool2d(grid, pool).flatten(2).transpose(1, 2)  # (N, T, Hv)
        return self.projector(x)  # (N, T, D)


def random_weights(config: VisionConfig, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Norms at one, biases at zero, everything else N(0, 0.02), drawn in name order: the same on every machine."""
    shapes = {name: tuple(t.shape) for name, t in VisionEncoder(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(shapes.items()):
        if "norm" in name:
            weights[name] = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        elif name.endswith("bias"):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * 0.02
    return weights


def save_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"format": "pt"})


def load_encoder(
    config: VisionConfig, weights_path: Path | None = None, seed: int = SEED, device: str = "cpu"
) -> VisionEncoder:
    """The encoder with weights from `weights_path` (safetensors) or random from `seed`; ConfigError for a file
    whose tensors do not fit `config`."""
    encoder = VisionEncoder(config)
    weights = random_weights(config, seed) if weights_path is None else _read(weights_path)
    expected = {name: tuple(t.shape) for name, t in encoder.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in weights.items()}
    if got != expected:
        wrong = sorted(set(got.items()) ^ set(expected.items()))[:3]
        raise ConfigError(
            f"vision weights {weights_path or 'seed ' + str(seed)} do not fit the vision_config: "
            f"{', '.join(f'{name} {shape}' for name, shape in wrong)}"
        )
    encoder.load_state_dict({k: v.float() for k, v in weights.items()})
    return encoder.eval().to(device)


def _read(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ConfigError(f"no vision weights at {path}")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a malformed file
        raise ConfigError(f"cannot read vision weights {path}: {exc}") from exc


def image_to_pixels(image: Image.Image, image_size: int) -> torch.Tensor:
    """An RGB image -> (3, S, S) float32 in [-1, 1]: resized (bicubic) to a square, scaled as SigLIP's are."""
    resized = image.convert("RGB").resize((image_size, image_size), Image.Resampling.BICUBIC)
    raw = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(image_size, image_size, 3)
    return raw.permute(2, 0, 1).float() / 127.5 - 1.0


@torch.inference_mode()
def encode_images(encoder: VisionEncoder, images: list[Image.Image]) -> torch.Tensor:
    """(N, T, D) float32 on the CPU."""
    device = next(encoder.parameters()).device
    pixels = torch.stack([image_to_pixels(image, encoder.config.image_size) for image in images]).to(device)
    return encoder(pixels).float().cpu()


EMBEDDING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def embeddings_to_bytes(embeddings: torch.Tensor) -> tuple[bytes, str]:
    """(raw row-major bytes, dtype name) of (T, D) embeddings, for the wire (encoder.proto PromptImage)."""
    names = {dtype: name for name, dtype in EMBEDDING_DTYPES.items()}
    return embeddings.contiguous().cpu().view(torch.uint8).numpy().tobytes(), names[embeddings.dtype]


def embeddings_from_bytes(data: bytes, dtype: str, num_tokens: int, hidden_size: int) -> torch.Tensor:
    """The inverse of embeddings_to_bytes; ValueError when the sizes do not add up."""
    if dtype not in EMBEDDING_DTYPES:
        raise ValueError(f"embeddings dtype {dtype!r} is not one of {', '.join(EMBEDDING_DTYPES)}")
    torch_dtype = EMBEDDING_DTYPES[dtype]
    if num_tokens < 1 or hidden_size < 1 or len(data) != num_tokens * hidden_size * torch_dtype.itemsize:
        raise ValueError(f"{len(data)} bytes of {dtype} embeddings do not hold {num_tokens} x {hidden_size}")
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).view(num_tokens, hidden_size)
