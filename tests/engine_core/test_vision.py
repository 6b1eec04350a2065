"""The vision encoder (engine_core.vision) and image bytes (engine_core.images): shapes, seeded weights, safetensors,
and the limits that turn bad images into errors naming the problem."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from engine_core.config import ConfigError
from engine_core.images import ImageError, ImageLimits, decode_image, image_hash, inspect_image
from engine_core.vision import (
    VisionConfig,
    encode_images,
    image_token_id,
    load_encoder,
    random_weights,
    save_weights,
)

CONFIG = VisionConfig(
    text_hidden_size=48, image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64
)


def png(width: int = 20, height: int = 12, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def gradient() -> Image.Image:
    return Image.frombytes("RGB", (16, 16), bytes(range(256)) * 3)


def test_output_is_one_row_per_image_token_in_the_language_models_width():
    encoder = load_encoder(CONFIG)
    out = encode_images(encoder, [gradient(), Image.new("RGB", (50, 10), (0, 0, 255))])
    assert out.shape == (2, 16, 48) and CONFIG.num_image_tokens == 16  # (32 / 8)^2 patches
    pooled = VisionConfig(**{**CONFIG.to_dict(), "pool": 2}, text_hidden_size=48)
    assert encode_images(load_encoder(pooled), [gradient()]).shape == (1, 4, 48)
    assert not torch.equal(out[0], out[1])  # different pixels, different embeddings


def test_weights_are_the_same_from_the_same_seed_and_differ_from_another():
    first, second = random_weights(CONFIG), random_weights(CONFIG)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    a = encode_images(load_encoder(CONFIG, seed=0), [gradient()])
    assert torch.equal(a, encode_images(load_encoder(CONFIG, seed=0), [gradient()]))
    assert not torch.allclose(a, encode_images(load_encoder(CONFIG, seed=1), [gradient()]))


def test_safetensors_round_trip_and_a_file_that_does_not_fit(tmp_path):
    path = tmp_path / "vision.safetensors"
    save_weights(random_weights(CONFIG, seed=7), path)
    assert torch.equal(
        encode_images(load_encoder(CONFIG, path), [gradient()]),
        encode_images(load_encoder(CONFIG, seed=7), [gradient()]),
    )
    wider = VisionConfig(**{**CONFIG.to_dict(), "hidden_size": 64}, text_hidden_size=48)
    with pytest.raises(ConfigError, match="do not fit the vision_config"):
        load_encoder(wider, path)
    with pytest.raises(ConfigError, match="no vision weights"):
        load_encoder(CONFIG, tmp_path / "missing.safetensors")


def test_model_config_says_whether_a_model_takes_images():
    raw = {"hidden_size": 48, "image_token_id": 9, "vision_config": CONFIG.to_dict()}
    assert VisionConfig.from_model_config(raw) == CONFIG and image_token_id(raw) == 9
    assert VisionConfig.from_model_config({"hidden_size": 48}) is None and image_token_id({"hidden_size": 48}) is None
    with pytest.raises(ConfigError, match="needs an image_token_id"):
        image_token_id({**raw, "image_token_id": None})
    with pytest.raises(ConfigError, match="multiple of patch_size"):
        VisionConfig(text_hidden_size=8, image_size=30, patch_size=8)


def test_images_are_checked_and_named_by_their_bytes():
    limits = ImageLimits(max_bytes=4096, max_side=64, max_pixels=64 * 32)
    data = png()
    assert inspect_image(data, limits).format == "PNG" and decode_image(data, limits).size == (20, 12)
    assert image_hash(data) == image_hash(png()) != image_hash(png(color=(0, 0, 0)))
    with pytest.raises(ImageError, match="not a PNG or JPEG"):
        inspect_image(b"GIF89a" + b"\0" * 64, limits)
    noisy = io.BytesIO()
    Image.frombytes("RGB", (32, 32), bytes(range(256)) * 12).save(noisy, "PNG")
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode_image(noisy.getvalue()[: len(noisy.getvalue()) // 2], limits)
    with pytest.raises(ImageError, match="is 65x10 pixels"):
        inspect_image(png(65, 10), limits)
    with pytest.raises(ImageError, match="is 64x64 pixels"):
        inspect_image(png(64, 64), limits)  # a side within the limit, too many pixels in all
    with pytest.raises(ImageError, match="the limit is 4096"):
        inspect_image(data + b"\0" * 4096, limits)
    jpeg = io.BytesIO()
    gradient().save(jpeg, "JPEG")
    assert inspect_image(jpeg.getvalue(), limits).format == "JPEG"
