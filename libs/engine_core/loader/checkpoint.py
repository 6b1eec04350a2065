"""Opens a model from disk, whatever its format: an HF directory or a GGUF file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_core.config import ConfigError, ModelConfig
from engine_core.loader import hf
from engine_core.tokenizer import Tokenizer


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # every weight under its HF name
    tokenizer: Tokenizer | None  # None: the model takes token ids only


def _gguf_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ConfigError(f"{path} holds several .gguf files; name one: {', '.join(f.name for f in files)}")
        return files[0] if files else None
    return None


def open_checkpoint(path: Path) -> Checkpoint:
    if not path.exists():
        raise ConfigError(f"no model at {path}")
    gguf_path = _gguf_file(path)
    if gguf_path is not None:
        return _open_gguf(gguf_path)
    if not path.is_dir():
        raise ConfigError(f"{path} is neither a model directory nor a .gguf file")
    config = ModelConfig.from_hf(hf.read_config(path))
    return Checkpoint(path, config, lambda: hf.iter_tensors(path), Tokenizer.from_dir(path))


def _open_gguf(path: Path) -> Checkpoint:
    from engine_core.loader.gguf import GGUFCheckpoint  # the gguf package is only needed for GGUF files

    try:
        gguf = GGUFCheckpoint(path)
        backend = gguf.tokenizer()
    except ValueError as exc:  # unsupported architecture, tensor type or tokenizer: the message names it
        raise ConfigError(str(exc)) from exc
    tokenizer = Tokenizer(
        backend,
        chat_template=gguf.chat_template,
        bos_token=gguf.bos_token,
        eos_token=gguf.eos_token,
        add_bos_token=gguf.add_bos_token,
    )
    return Checkpoint(path, ModelConfig.from_hf(gguf.config), gguf.tensors, tokenizer)
