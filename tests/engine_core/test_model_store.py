"""Known models: deepseek-tiny is written once as an ordinary HF directory that transformers itself loads."""

from __future__ import annotations

import pytest
import torch

from engine_core import LLM, ConfigError, SamplingParams, model_store
from engine_core.tiny import DEEPSEEK_TINY_CONFIG, random_weights


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVMESH_MODEL_DIR", str(root))
        assert not model_store.is_present("deepseek-tiny")
        path = model_store.ensure("deepseek-tiny")
        assert model_store.is_present("deepseek-tiny")
    return path


def test_random_weights_are_the_same_on_every_machine():
    small = {**DEEPSEEK_TINY_CONFIG, "vocab_size": 64, "num_hidden_layers": 2}
    first, second = random_weights(small), random_weights(small)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert first["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert first["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    assert sorted(k for k in first if ".experts." in k)[:2] == [
        "model.layers.1.mlp.experts.0.down_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
    ]


def test_deepseek_tiny_loads_in_transformers_and_matches_our_engine(tiny_dir):
    from transformers import DeepseekV3ForCausalLM

    reference = DeepseekV3ForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    llm = LLM(str(tiny_dir), device="cpu", num_kv_blocks=32)
    prompt = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there!"}]), add_special_tokens=False
    )
    assert prompt[:2] == [0, 128803]  # <｜begin▁of▁sentence｜><｜User｜>
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.token_ids == expected[0, len(prompt) :].tolist()
    assert llm.engine.model_config.moe.num_experts == 16 and llm.engine.model_config.mla.kv_lora_rank == 64


def test_unknown_names_and_missing_paths_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_MODEL_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'"):
        model_store.resolve("gpt-5")
    with pytest.raises(ConfigError, match="kvmesh models pull smollm2-135m"):
        model_store.resolve("smollm2-135m", fetch=False)
