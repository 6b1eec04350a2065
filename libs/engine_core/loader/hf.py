"""Hugging Face model directories: config.json plus safetensors shards (optionally FP8 block-quantized)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine_core.config import ConfigError

FP8_BLOCK = (128, 128)  # DeepSeek-V3's FP8 checkpoints scale each 128x128 tile of a weight


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{path} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"malformed model config {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"malformed model config {config_path}: expected a JSON object")
    _check_quantization(config)
    generation = path / "generation_config.json"
    if generation.is_file():  # its eos ids (often several) decide when generation stops
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            config = {**config, "eos_token_id": eos}
    return config


def _check_quantization(config: dict[str, Any]) -> None:
    quant = config.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method")
    if method != "fp8" or list(quant.get("weight_block_size", FP8_BLOCK)) != list(FP8_BLOCK):
        raise ConfigError(
            f"unsupported quantization {method!r} (block {quant.get('weight_block_size')}): "
            "supported are unquantized checkpoints and fp8 with 128x128 blocks"
        )


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights")
    return files


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """weight (out, in) float8 with one scale per 128x128 tile, scale_inv (ceil(out/128), ceil(in/128))."""
    rows, cols = weight.shape
    scale = scale_inv.repeat_interleave(FP8_BLOCK[0], 0)[:rows].repeat_interleave(FP8_BLOCK[1], 1)[:, :cols]
    return weight.float() * scale.float()


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint under its name, FP8 weights dequantized to float32."""
    for file in _shard_files(path):
        with safe_open(str(file), framework="pt") as handle:
            names = set(handle.keys())
            for name in sorted(names):
                if name.endswith("_scale_inv"):
                    continue
                tensor = handle.get_tensor(name)
                scale_name = name + "_scale_inv"
                if tensor.dtype == torch.float8_e4m3fn:
                    if scale_name not in names:
                        raise ConfigError(f"fp8 tensor {name!r} in {file.name} has no {scale_name!r}")
                    tensor = dequantize_fp8(tensor, handle.get_tensor(scale_name))
                yield name, tensor
