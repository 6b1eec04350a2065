"""deepseek-v4-tiny: a directory transformers' DeepseekV4ForCausalLM loads whole, which greedily says what ours says,
written by `kvmesh models pull` and rewritten when its version is old."""

from __future__ import annotations

import json

import pytest
import torch

from engine_core import LLM, SamplingParams, model_store
from engine_core.tiny_v4 import DEEPSEEK_V4_TINY_CONFIG, random_weights, write_deepseek_v4_tiny

NUM_NEW = 8


@pytest.fixture(scope="module")
def v4_tiny(tmp_path_factory: pytest.TempPathFactory):
    return write_deepseek_v4_tiny(tmp_path_factory.mktemp("models") / "deepseek-v4-tiny")


def test_every_layer_type_is_there():
    config = DEEPSEEK_V4_TINY_CONFIG
    assert set(config["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert config["mlp_layer_types"].count("hash_moe") == 2
    weights = random_weights(config)
    assert weights["layers.0.ffn.gate.tid2eid"].shape == (129280, 4)
    # each token id's experts are distinct
    assert all(len(set(row)) == 4 for row in weights["layers.1.ffn.gate.tid2eid"][:1000].tolist())


def test_transformers_loads_it_and_greedy_tokens_agree(v4_tiny):
    """A prompt of 80 tokens crosses the window (32), closes 5 HCA windows (16) and 20 CSA windows (4), more
    than the indexer keeps (16); 8 greedy steps close two more CSA windows."""
    transformers = pytest.importorskip("transformers", minversion="5.8")
    reference, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        v4_tiny, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    llm = LLM(str(v4_tiny), device="cpu")
    prompt = llm.engine.tokenize_prompt("The quick brown fox jumps over the lazy dog. " * 8)[:80]
    assert len(prompt) == 80
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True))[0]
    with torch.no_grad():
        expected = reference.eval().generate(
            torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False
        )
    assert ours.token_ids == expected[0, len(prompt) :].tolist()


def test_pull_writes_it_and_an_old_version_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_MODEL_DIR", str(tmp_path))
    assert not model_store.is_present("deepseek-v4-tiny")
    path = model_store.ensure("deepseek-v4-tiny")
    assert path == tmp_path / "deepseek-v4-tiny"
    config = json.loads((path / "config.json").read_text())
    assert config == DEEPSEEK_V4_TINY_CONFIG
    (path / "config.json").write_text(json.dumps({**config, "kvmesh_tiny_version": 0}))
    assert not model_store.is_present("deepseek-v4-tiny")
    model_store.ensure("deepseek-v4-tiny")
    assert json.loads((path / "config.json").read_text()) == config
