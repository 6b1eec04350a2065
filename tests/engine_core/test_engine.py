"""The engine's step API end to end on small models: KV export/import, preemption, budgets, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine_core import LLM, ConfigError, EngineConfig, LLMEngine, PromptError, SamplingParams
from engine_core.kv_cache.events import BlockStored
from engine_core.kv_transfer import KVLayoutError


def run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def handoff(prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """Prefill computes the prompt and the first token, then its KV moves to the decode engine layer by layer."""
    prefill.add_request(request_id, prompt, SamplingParams(**{**vars(params), "max_tokens": 1}), keep_kv=True)
    first = run_to_completion(prefill)[request_id]
    export = prefill.export_kv(request_id)
    assert export.num_tokens == len(prompt) and export.output_token_ids == first
    assert decode.begin_kv_import(
        request_id, export.prompt_token_ids, export.output_token_ids, params, export.layout, export.num_tokens
    )
    for chunk in export.chunks(max_bytes=export.layout.chunk_bytes(2)):  # a layer in several chunks
        decode.import_kv_chunk(request_id, chunk.layer, chunk.data, chunk.first_block)
    decode.finish_kv_import(request_id)
    prefill.release(request_id)
    return first + run_to_completion(decode)[request_id]


@pytest.mark.parametrize("reference", ["deepseek_reference", "llama_reference"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_imported_kv_decodes_exactly_as_in_place(reference, params, request):
    path, _ = request.getfixturevalue(reference)
    prompt = torch.randint(3, 400, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    in_place = LLMEngine(EngineConfig(str(path), device="cpu", num_kv_blocks=32))
    in_place.add_request("r", prompt, params)
    expected = run_to_completion(in_place)["r"]

    prefill = LLMEngine(EngineConfig(str(path), device="cpu", num_kv_blocks=32))
    decode = LLMEngine(EngineConfig(str(path), device="cpu", num_kv_blocks=32))
    assert handoff(prefill, decode, "r", prompt, params) == expected
    assert decode.stats().num_prompt_tokens_computed == 0  # decode never recomputed the prompt
    assert prefill.stats().num_free_kv_blocks == 32  # released after export
    assert decode.stats().num_free_kv_blocks == 32


def test_kv_import_refuses_foreign_layouts_and_wrong_sizes(llama_reference, deepseek_reference):
    llama = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=16))
    deepseek = LLMEngine(EngineConfig(str(deepseek_reference[0]), device="cpu", num_kv_blocks=16))
    llama.add_request("r", list(range(3, 23)), SamplingParams(max_tokens=1), keep_kv=True)
    run_to_completion(llama)
    export = llama.export_kv("r")
    with pytest.raises(KVLayoutError, match="KV layout mismatch"):
        deepseek.begin_kv_import(
            "r", export.prompt_token_ids, export.output_token_ids, SamplingParams(), export.layout, export.num_tokens
        )
    other = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=16))
    assert other.begin_kv_import(
        "r", export.prompt_token_ids, export.output_token_ids, SamplingParams(), export.layout, export.num_tokens
    )
    with pytest.raises(KVLayoutError, match="does not fit"):
        other.import_kv_chunk("r", 0, b"\0" * 10)
    with pytest.raises(KVLayoutError, match="does not fit"):
        other.import_kv_chunk("r", 0, b"\0" * export.layout.chunk_bytes(1), first_block=5)
    assert other.abort_request("r") and other.stats().num_free_kv_blocks == 16


def test_preemption_by_recompute_gives_the_same_tokens(deepseek_reference):
    path, _ = deepseek_reference
    prompts = [
        torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 25, 30, 35)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
    ] * 2
    roomy = LLM(str(path), device="cpu", num_kv_blocks=64).generate(prompts, params)
    tight = LLM(str(path), device="cpu", num_kv_blocks=8, block_size=8)
    assert [o.token_ids for o in tight.generate(prompts, params)] == [o.token_ids for o in roomy]
    assert tight.engine.stats().num_preemptions > 0


def test_the_kv_memory_budget_is_never_exceeded(llama_reference):
    budget = 200_000
    engine = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", kv_cache_memory_bytes=budget))
    bytes_per_block = 3 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block * kv heads * head size * fp32
    assert engine.kv.num_blocks == budget // bytes_per_block == 16
    assert engine.runner.kv_cache_bytes == 16 * bytes_per_block == 196_608
    assert engine.max_model_len == 16 * 16  # below the model's 1024: one request must always fit the cache
    with pytest.raises(ConfigError, match="holds no block"):
        LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", kv_cache_memory_bytes=100))


def test_a_seeded_request_is_independent_of_its_batch(llama_reference):
    llm = LLM(str(llama_reference[0]), device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)
    crowded = llm.generate([[9, 9, 9], [5, 6, 7, 8], list(range(40, 80))], [others, params, others])
    assert crowded[1].token_ids == alone


def test_stop_token_ids_and_abort(llama_reference):
    llm = LLM(str(llama_reference[0]), device="cpu", num_kv_blocks=64)
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy[2]]))[0]
    assert stopped.token_ids == greedy[: greedy.index(greedy[2]) + 1] and stopped.finish_reason == "stop"

    engine = llm.engine
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().num_free_kv_blocks < 64
    assert engine.abort_request("a")
    assert engine.stats().num_free_kv_blocks == 64
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("a", "abort")]


def test_kv_events_report_stored_blocks(llama_reference):
    engine = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=16, served_name="m"))
    engine.add_request("a", list(range(3, 39)), SamplingParams(max_tokens=1))
    run_to_completion(engine)
    events = engine.take_kv_events()
    assert [type(e) for e in events] == [BlockStored]
    assert len(events[0].block_hashes) == 2 and events[0].token_ids == tuple(range(3, 35))
    assert engine.take_kv_events() == []


def test_bad_prompts_are_refused_and_the_engine_carries_on(llama_reference):
    engine = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=8, block_size=16))
    assert engine.max_model_len == 128
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(PromptError, match="empty"):
        engine.add_request("empty", [])
    with pytest.raises(PromptError, match=r"in \[0, 500\)"):
        engine.add_request("oov", [5, 500])
    with pytest.raises(PromptError, match="128 tokens; this model's context is 128"):
        engine.add_request("long", [5] * 128)
    with pytest.raises(PromptError, match="no tokenizer"):
        engine.add_request("text", "hello")
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.add_request("good", [1])
    assert len(run_to_completion(engine)["good"]) == 3


def test_bad_models_are_refused_naming_the_problem(tmp_path, llama_reference):
    with pytest.raises(ConfigError, match="unknown model 'no-such-model'"):
        LLMEngine(EngineConfig("no-such-model"))
    broken = tmp_path / "broken"
    shutil.copytree(llama_reference[0], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed model config"):
        LLMEngine(EngineConfig(str(broken), device="cpu"))
    (broken / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    with pytest.raises(ConfigError, match="missing 'hidden_size'"):
        LLMEngine(EngineConfig(str(broken), device="cpu"))
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ConfigError, match="unsupported model_type 'mamba'"):
        LLMEngine(EngineConfig(str(broken), device="cpu"))
    (broken / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ConfigError, match="unsupported quantization 'gptq'"):
        LLMEngine(EngineConfig(str(broken), device="cpu"))
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        EngineConfig(str(broken), block_size=0)
    with pytest.raises(ConfigError, match="dtype must be"):
        EngineConfig(str(broken), dtype="int3")


def test_real_weights_answer_sensibly(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=16)
    )
    assert out.text == "The capital of France is Paris." and out.finish_reason == "stop"


@pytest.mark.parametrize("reference", ["deepseek_reference", "llama_reference"])
def test_blocks_read_from_one_engine_serve_as_prefix_hits_in_another(reference, request):
    path, _ = request.getfixturevalue(reference)
    prompt = torch.randint(3, 400, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    source = LLM(str(path), device="cpu", num_kv_blocks=32, served_name="m")
    expected = source.generate([prompt], params)[0].token_ids
    hashes = source.engine.prompt_block_hashes(prompt)
    assert len(hashes) == 2 and source.engine.num_cached_blocks(hashes) == 2
    data = source.engine.read_cached_blocks([*hashes, b"\0" * 32])
    layout = source.engine.kv_layout
    assert data[2] is None and len(data[0]) == layout.num_layers * layout.chunk_bytes(1)

    target = LLM(str(path), device="cpu", num_kv_blocks=32, served_name="m")
    from engine_core.kv_cache.block_hash import root_hash

    assert target.engine.inject_cached_blocks(root_hash("m"), hashes, prompt[:32], data[:2]) == 2
    assert target.engine.num_cached_blocks(hashes) == 2 and target.engine.stats().num_free_kv_blocks == 32
    out = target.generate([prompt], params)[0]
    assert out.num_cached_tokens == 32 and out.token_ids == expected
    assert target.engine.stats().num_prompt_tokens_computed == 45 - 32
    salted = target.engine.prompt_block_hashes(prompt, cache_salt="tenant")
    assert target.engine.num_cached_blocks(salted) == 0  # another tenant's keys never match
