"""Layer-by-layer KV loads: the forward pass starts before the loaded KV has all arrived and gives exactly the
tokens of a cold run; a load that fails mid-step makes its request recompute, never a wrong token."""

from __future__ import annotations

import threading
import time

import pytest

from engine_core import EngineConfig, LLMEngine, SamplingParams
from engine_core.kv_cache.block_hash import root_hash

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [(i * 37) % 480 + 3 for i in range(70)]  # 4 full blocks of 16, then 6 tokens


def run(engine: LLMEngine, request_id: str) -> tuple[list[int], int]:
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.new_token_ids
                cached = output.num_cached_tokens
    return tokens, cached


@pytest.fixture(scope="module")
def stored(llama_reference):
    """(tokens of a cold run, the prompt's full blocks as a KV store holds them: all layers, layer 0 first)."""
    engine = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=32, served_name="m"))
    engine.add_request("cold", PROMPT, GREEDY)
    tokens, _ = run(engine, "cold")
    keys = engine.prompt_block_hashes(PROMPT)
    return tokens, keys, engine.read_cached_blocks(keys), engine.kv_layout


def layer_pieces(blocks: list[bytes], layout, layer: int) -> list[bytes]:
    size = layout.chunk_bytes(1)
    return [block[layer * size : (layer + 1) * size] for block in blocks]


def test_the_forward_pass_waits_per_layer_and_gives_the_cold_tokens(llama_reference, stored):
    cold, keys, blocks, layout = stored
    engine = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=32, served_name="m"))
    load = engine.loads.begin(root_hash("m"), keys, PROMPT[: 16 * len(keys)])
    engine.add_request("warm", PROMPT, GREEDY)
    waits: list[tuple[int, int]] = []  # (layer asked for, layers written at that moment)
    original = engine.loads.wait_for_layer

    def recording(layer, loads):
        waits.append((layer, load.num_layers_done))
        original(layer, loads)

    engine.loads.wait_for_layer = recording  # type: ignore[method-assign]

    def loader() -> None:  # each layer arrives only once the forward pass is waiting for it
        for layer in range(layout.num_layers):
            while len(waits) <= layer:
                time.sleep(0.001)
            engine.loads.write_layer(load, layer, layer_pieces(blocks, layout, layer))

    thread = threading.Thread(target=loader)
    thread.start()
    tokens, cached = run(engine, "warm")
    thread.join()
    assert (tokens, cached) == (cold, 64)
    # the step ran each layer as soon as its KV arrived, while the later layers were still on their way
    assert waits == [(layer, layer) for layer in range(layout.num_layers)]
    assert engine.loads.pending == [] and engine.num_cached_blocks(keys) == 4


def test_a_load_that_fails_mid_step_makes_its_request_recompute(llama_reference, stored):
    cold, keys, blocks, layout = stored
    engine = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=32, served_name="m"))
    load = engine.loads.begin(root_hash("m"), keys, PROMPT[: 16 * len(keys)])
    engine.add_request("warm", PROMPT, GREEDY)

    def loader() -> None:
        engine.loads.write_layer(load, 0, layer_pieces(blocks, layout, 0))
        time.sleep(0.05)
        engine.loads.fail(load)  # e.g. the store node went away, or a block failed its checksum

    thread = threading.Thread(target=loader)
    thread.start()
    assert engine.step() == []  # interrupted: nothing sampled from half-loaded KV
    thread.join()
    assert engine.num_cached_blocks(keys) == 0  # the failed blocks left the prefix cache
    tokens, cached = run(engine, "warm")
    assert (tokens, cached) == (cold, 0)  # recomputed from scratch
    assert engine.stats().num_prefix_hit_tokens == 0


def test_a_load_that_never_arrives_times_out_into_a_recompute(llama_reference, stored):
    cold, keys, _, _ = stored
    engine = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=32, served_name="m"))
    engine.loads.timeout_s = 0.1
    engine.loads.begin(root_hash("m"), keys, PROMPT[: 16 * len(keys)])
    engine.add_request("warm", PROMPT, GREEDY)
    assert run(engine, "warm") == (cold, 0)


def test_steps_that_do_not_read_a_pending_load_never_wait(llama_reference, stored):
    _cold, keys, _, _ = stored
    engine = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=32, served_name="m"))
    load = engine.loads.begin(root_hash("m"), keys, PROMPT[: 16 * len(keys)])  # nobody writes it
    other = [5, 6, 7] * 10
    engine.add_request("other", other, GREEDY)
    started = time.monotonic()
    tokens, _ = run(engine, "other")
    assert len(tokens) == 6 and time.monotonic() - started < 5 and not load.failed
