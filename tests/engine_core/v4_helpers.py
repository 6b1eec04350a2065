"""A small random DeepSeek-V4 directory (test_deepseek_v4_config's config, every layer type) without transformers:
the weights deepseek-v4-tiny's writer draws, for that config."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from engine_core.tiny_v4 import random_weights
from tests.engine_core.test_deepseek_v4_config import V4_TEST_CONFIG

SMALL_V4_CONFIG = {**V4_TEST_CONFIG, "model_type": "deepseek_v4", "hc_mult": 4, "n_shared_experts": 1}


def write_small_v4(path: Path, seed: int = 3) -> Path:
    """4 layers (window, CSA, HCA, CSA; the first two hash-routed), 8 experts, 2 per token, vocabulary 512."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(random_weights(SMALL_V4_CONFIG, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(SMALL_V4_CONFIG))
    return path
