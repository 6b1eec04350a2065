"""Expert parallelism in the engine (deepseek-tiny: 3 MoE layers of 16 experts in 4 groups, 4 per token): exact
counts against the gate's own choices, dispatch to replicas, outputs that do not depend on the placement, and a
placement changed in the middle of generation."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine_core import ConfigError, EngineConfig, LLMEngine, SamplingParams, model_store
from engine_core.expert_parallel import ExpertLayout, ExpertParallel, PreparedPlacement
from engine_core.models.deepseek_v3 import DeepseekMoE
from engine_core.models.experts import PhysicalExperts
from mesh import eplb

PROMPTS = [[1, 5, 9, 33, 7, 100, 200], [4000, 17, 5], [9, 9, 9, 9, 10, 11, 12, 13, 14, 15]]
REPLICATED = [*range(16), 0, 1, 2, 3]  # the default placement of 4 redundant slots


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(model_store.ensure("deepseek-tiny"))


@pytest.fixture(scope="module")
def single(tiny_path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(tiny_path, device="cpu", num_kv_blocks=64))


@pytest.fixture(scope="module")
def parallel(tiny_path: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(tiny_path, device="cpu", num_kv_blocks=64, expert_parallel_size=4, num_redundant_experts=4)
    )


@pytest.fixture(scope="module")
def reference(single: LLMEngine) -> dict[int, list[int]]:
    """Greedy tokens of PROMPTS on one rank, no replicas."""
    return generate(single, "ref", max_tokens=10)


def moe_layers(engine: LLMEngine) -> list[DeepseekMoE]:
    return [layer.mlp for layer in engine.runner.model.model.layers if isinstance(layer.mlp, DeepseekMoE)]


def generate(engine: LLMEngine, tag: str, max_tokens: int = 10, between_steps=None) -> dict[int, list[int]]:
    """Greedy tokens of every prompt, all in one batch; between_steps(step) runs after each step."""
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[int(out.request_id.rsplit("-", 1)[1])].extend(out.new_token_ids)
        step += 1
        if between_steps is not None:
            between_steps(step)
    return tokens


def test_dispatch_rotates_tokens_over_an_experts_replicas() -> None:
    weights = torch.arange(4.0)[:, None, None].expand(4, 2, 1)
    placement = PhysicalExperts.build([0, 1, 2, 3, 0, 1], weights, weights, num_ranks=2, version=1)
    assert placement.log2phy.tolist() == [[0, 4], [1, 5], [2, -1], [3, -1]]
    assert placement.w_gate_up[:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0]  # slot order
    topk_ids = torch.tensor([[0, 1], [0, 2], [0, 3]])
    assert placement.dispatch(topk_ids, first_token=0).tolist() == [[0, 1], [4, 2], [0, 3]]
    assert placement.dispatch(topk_ids, first_token=1).tolist() == [[4, 5], [0, 2], [4, 3]]
    identity = PhysicalExperts.build(range(4), weights, weights, num_ranks=1, version=0)
    assert identity.w_gate_up is weights  # no copy for the identity placement


def test_counts_are_the_gates_own_choices(single: LLMEngine) -> None:
    single.take_expert_report()  # start from zero
    chosen: list[list[torch.Tensor]] = [[] for _ in moe_layers(single)]
    hooks = [
        layer.gate.register_forward_hook(lambda m, args, out, i=i: chosen[i].append(out[0].clone()))
        for i, layer in enumerate(moe_layers(single))
    ]
    try:
        single.add_request("counted", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while single.has_unfinished_requests():
            single.step()
    finally:
        for hook in hooks:
            hook.remove()
    report = single.take_expert_report()
    assert report is not None
    assert (report.version, report.num_steps) == (0, 2)  # the prompt's 7 tokens, then one decode token
    expected = [torch.bincount(torch.cat(ids).flatten(), minlength=16).tolist() for ids in chosen]
    assert report.counts == expected
    assert report.rank_loads == [[8 * 4]] * 3  # 8 tokens x 4 experts, all on the one rank
    assert single.take_expert_report() is None  # nothing since


def test_replicas_compute_what_their_expert_computes(single: LLMEngine) -> None:
    layer = moe_layers(single)[0]
    x = torch.randn(24, layer.w_gate_up.shape[2], generator=torch.Generator().manual_seed(0))
    counters, layer.counters = layer.counters, None  # this engine counts 16 slots, not 20
    with torch.inference_mode():
        logical = layer(x)
        layer.placement = PhysicalExperts.build(REPLICATED, layer.w_gate_up, layer.w_down, num_ranks=4, version=1)
        try:
            parallel = layer(x)
        finally:
            layer.placement, layer.counters = None, counters
    torch.testing.assert_close(parallel, logical, rtol=1e-5, atol=1e-6)


def test_expert_parallel_engine_generates_the_same_tokens(parallel: LLMEngine, reference: dict[int, list[int]]) -> None:
    assert parallel.expert_layout == ExpertLayout(
        num_layers=3, first_layer=1, num_experts=16, num_groups=4, num_slots=20, num_ranks=4
    )
    parallel.take_expert_report()
    assert generate(parallel, "ep") == reference
    report = parallel.take_expert_report()
    assert report is not None and report.version == 0
    assert [sum(r) for r in report.rank_loads] == [sum(c) for c in report.counts]  # every pair computed once
    assert parallel.experts is not None and parallel.experts.phy2log() == [REPLICATED] * 3


def test_rebalance_in_the_middle_of_generation_changes_no_token(
    parallel: LLMEngine, reference: dict[int, list[int]]
) -> None:
    layout = parallel.expert_layout
    assert layout is not None
    parallel.take_expert_report()
    prepared: list[PreparedPlacement] = []

    def rebalance_after_step(step: int) -> None:
        if step != 3:
            return
        report = parallel.take_expert_report()
        assert report is not None and parallel.experts is not None
        topology = eplb.Topology(layout.num_slots, layout.num_groups, 1, layout.num_ranks)
        plan = eplb.rebalance(np.array(report.counts), topology, np.array(parallel.experts.phy2log()))
        assert plan.num_moved.sum() > 0
        # the weights are copied on another thread while nothing else waits; the swap is between two steps
        worker = threading.Thread(
            target=lambda: prepared.append(parallel.prepare_expert_placement(plan.phy2log.tolist(), version=1))
        )
        worker.start()
        worker.join()
        assert parallel.apply_expert_placement(prepared[0])

    assert generate(parallel, "moved", between_steps=rebalance_after_step) == reference
    assert parallel.experts is not None and parallel.experts.version == 1
    assert parallel.experts.phy2log() != [REPLICATED] * 3
    assert not parallel.apply_expert_placement(prepared[0])  # not newer than what runs
    report = parallel.take_expert_report()
    assert report is not None and report.version == 1


def test_placements_and_settings_that_do_not_fit_are_refused(
    single: LLMEngine, parallel: LLMEngine, tiny_path: str
) -> None:
    with pytest.raises(ValueError, match="needs 20 slots, got 16"):
        parallel.prepare_expert_placement([list(range(16))] * 3, version=5)
    with pytest.raises(ValueError, match="every expert needs a slot"):
        parallel.prepare_expert_placement([list(range(15)) + [0] * 5] * 3, version=5)
    with pytest.raises(ValueError, match="needs 3 MoE layers"):
        parallel.prepare_expert_placement([REPLICATED], version=5)
    with pytest.raises(ConfigError, match="expert_parallel_size 3 must divide the 16 expert slots"):
        ExpertParallel.attach(single.runner.model, single.model_config, EngineConfig(tiny_path, expert_parallel_size=3))
    with pytest.raises(ConfigError, match="num_redundant_experts"):
        EngineConfig(tiny_path, num_redundant_experts=-1)
