"""Expert parallelism on DeepSeek-V4: every layer is MoE, hash-routed ones included. Counts are exactly what the
router chose (on hash layers, the checkpoint's token-id table), and a placement with replicas changes no token."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine_core import EngineConfig, LLMEngine, SamplingParams
from tests.engine_core.test_engine import run_to_completion
from tests.engine_core.v4_helpers import write_small_v4

PROMPTS = [[3, 9, 27, 81, 243, 100, 200, 300], [4, 5, 6], list(range(10, 40))]


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory: pytest.TempPathFactory):
    return write_small_v4(tmp_path_factory.mktemp("v4-experts"))


def generate(engine: LLMEngine, tag: str) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", prompt, params)
    tokens = run_to_completion(engine)
    return [tokens[f"{tag}-{i}"] for i in range(len(PROMPTS))]


def test_every_layer_is_counted_and_hash_layers_count_their_table(v4_path):
    engine = LLMEngine(EngineConfig(str(v4_path), device="cpu", num_kv_blocks=32))
    layout = engine.expert_layout
    assert layout is not None
    assert (layout.num_layers, layout.first_layer, layout.num_experts, layout.num_groups) == (4, 0, 8, 1)
    engine.add_request("r", PROMPTS[2], SamplingParams(max_tokens=1))  # the prompt only: one forward
    run_to_completion(engine)
    report = engine.take_expert_report()
    assert report is not None and report.num_steps == 1
    assert all(sum(row) == len(PROMPTS[2]) * 2 for row in report.counts)  # 2 experts per token, every layer
    table = load_file(str(v4_path / "model.safetensors"))["layers.1.ffn.gate.tid2eid"]
    expected = torch.bincount(table[PROMPTS[2]].flatten(), minlength=8).tolist()
    assert report.counts[1] == expected


def test_a_placement_with_replicas_changes_no_token(v4_path):
    single = LLMEngine(EngineConfig(str(v4_path), device="cpu", num_kv_blocks=32))
    parallel = LLMEngine(
        EngineConfig(str(v4_path), device="cpu", num_kv_blocks=32, expert_parallel_size=2, num_redundant_experts=2)
    )
    placement = [7, 6, 5, 4, 3, 2, 1, 0, 7, 0]  # reversed, experts 7 and 0 twice
    assert parallel.set_expert_placement([placement] * 4, version=1)
    assert generate(parallel, "p") == generate(single, "s")
    report = parallel.take_expert_report()
    assert report is not None and report.version == 1
    assert all(sum(loads) == sum(counts) for loads, counts in zip(report.rank_loads, report.counts, strict=True))
