"""deepseek-tiny v2 takes images: a placeholder token and a vision_config. A directory written by an older kvmesh
(no version marker) is rewritten on first use, with the same language-model weights."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from engine_core import model_store
from engine_core.tiny import IMAGE_TOKEN, IMAGE_TOKEN_ID
from engine_core.tokenizer import Tokenizer
from engine_core.vision import VisionConfig, image_token_id


def test_an_old_directory_is_rewritten_with_the_image_token(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_MODEL_DIR", str(tmp_path))
    path = model_store.ensure("deepseek-tiny")
    weights = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    assert config["kvmesh_tiny_version"] == model_store.DEEPSEEK_TINY_VERSION
    assert image_token_id(config) == IMAGE_TOKEN_ID and VisionConfig.from_model_config(config) is not None
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer is not None
    assert tokenizer.encode(f"a {IMAGE_TOKEN} b", add_special_tokens=False).count(IMAGE_TOKEN_ID) == 1
    assert tokenizer.decode([IMAGE_TOKEN_ID]) == ""  # special: never shows in generated text

    old = {k: v for k, v in config.items() if k not in ("kvmesh_tiny_version", "image_token_id", "vision_config")}
    (path / "config.json").write_text(json.dumps(old))  # what kvmesh wrote before images
    assert not model_store.is_present("deepseek-tiny")
    model_store.ensure("deepseek-tiny")
    assert model_store.is_present("deepseek-tiny")
    assert json.loads((path / "config.json").read_text()) == config
    again = load_file(str(path / "model.safetensors"))
    assert all(again[name].equal(tensor) for name, tensor in weights.items())
