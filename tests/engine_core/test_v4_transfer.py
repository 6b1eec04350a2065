"""DeepSeek-V4 KV between engines: a request's whole state (windows, compressor tails and entries, the indexer's
keys) in per-layer sections (mesh.kv_blocks.StateSections). After a handoff, decode goes on exactly as one engine would;
V4 KV offered to a V3 engine, or the reverse, is refused as a layout mismatch (a miss), never misread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine_core import EngineConfig, LLMEngine, SamplingParams
from engine_core.kv_cache.block_hash import root_hash
from engine_core.kv_transfer import KVLayoutError, tensor_to_bytes
from mesh.kv_blocks import KVLayout, layout_from_proto, layout_to_proto
from tests.engine_core.test_engine import handoff, run_to_completion
from tests.engine_core.v4_helpers import write_small_v4

# window 8, CSA ratio 4, HCA ratio 8: 5 tokens close no window; 23 leave every tail open; 40 closes every window
PROMPT_LENGTHS = (5, 23, 40)


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory: pytest.TempPathFactory):
    return write_small_v4(tmp_path_factory.mktemp("v4-transfer"))


def engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(str(path), device="cpu", num_kv_blocks=32, **kwargs))


@pytest.mark.parametrize("num_prompt_tokens", PROMPT_LENGTHS)
def test_decode_after_a_handoff_is_exactly_a_single_engine_run(v4_path, num_prompt_tokens):
    prompt = torch.randint(3, 512, (num_prompt_tokens,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
    in_place = engine(v4_path)
    in_place.add_request("r", prompt, params)
    expected = run_to_completion(in_place)["r"]
    prefill, decode = engine(v4_path), engine(v4_path)
    assert handoff(prefill, decode, "r", prompt, params) == expected
    assert prefill.runner.sequence_states == {}  # released with the request
    decode.runner.drop_finished_states()  # as the next step would
    assert decode.runner.sequence_states == {}


def test_the_export_is_one_section_per_layer_of_the_sizes_the_layout_gives(v4_path):
    prefill = engine(v4_path)
    prefill.add_request("r", list(range(3, 26)), SamplingParams(max_tokens=1), keep_kv=True)
    run_to_completion(prefill)
    export = prefill.export_kv("r")
    layout = export.layout
    assert layout.sections is not None and layout.sections.layer_kinds == ("window", "csa", "hca", "csa")
    chunks = list(export.chunks(max_bytes=1))  # a section is never split
    assert [(c.layer, c.first_block, c.num_blocks) for c in chunks] == [(layer, 0, 2) for layer in range(4)]
    # 23 tokens, fp32, D 32: window 7 rows; CSA (m 4, 2 series): tail 3 x 64 twice, 5 entries, overlap 4 x 32
    # twice, then the indexer's (width 16); HCA (m 8): tail 7 x 32 twice, 2 entries
    csa = (7 * 32 + 2 * 3 * 64 + 5 * 32 + 2 * 4 * 32 + 2 * 3 * 32 + 5 * 16 + 2 * 4 * 16) * 4
    assert [len(c.data) for c in chunks] == [7 * 32 * 4, csa, (7 * 32 + 2 * 7 * 32 + 2 * 32) * 4, csa]
    assert layout.transfer_bytes(export.num_blocks, export.num_tokens) == sum(len(c.data) for c in chunks)
    assert layout_from_proto(layout_to_proto(layout)) == layout


def test_v3_kv_is_a_miss_for_v4_and_the_reverse(v4_path, deepseek_reference):
    v4, v3 = engine(v4_path), engine(deepseek_reference[0])
    for source, target in ((v3, v4), (v4, v3)):
        source.add_request("r", list(range(3, 23)), SamplingParams(max_tokens=1), keep_kv=True)
        run_to_completion(source)
        export = source.export_kv("r")
        with pytest.raises(KVLayoutError, match="KV layout mismatch"):
            target.begin_kv_import(
                "r",
                export.prompt_token_ids,
                export.output_token_ids,
                SamplingParams(),
                export.layout,
                export.num_tokens,
            )
        source.release("r")
    # the block layouts differ too: a store block of one is never entered into the other's cache
    assert v4.kv_layout != v3.kv_layout and v4.kv_layout.sections is None
    assert (v3.kv_layout.block_format, v4.kv_layout.block_format) == (1, 2)
    # V3's stored block is its cache rows, as before block formats had numbers
    (key,) = v3.prompt_block_hashes(list(range(3, 23)))
    block = v3.kv.pool.get_cached_block(key)
    assert block is not None
    assert v3.read_cached_blocks([key]) == [tensor_to_bytes(v3.runner.read_all_layers(block.block_id))]


def test_a_format_1_layout_is_written_as_before_sections_existed():
    """V3/Llama layouts: the same protobuf bytes as before block formats had numbers (fields 1-6 only)."""
    layout = KVLayout("deepseek-tiny", "float32", 16, 4, (1, 16, 80), 0)
    data = layout_to_proto(layout).SerializeToString()
    assert data == bytes.fromhex("0a0d646565707365656b2d74696e791207666c6f61743332181020042a03011050")
    assert not layout_to_proto(layout).HasField("sections")
    assert layout_from_proto(layout_to_proto(layout)) == layout


def test_an_import_missing_a_layer_is_refused(v4_path):
    prefill, decode = engine(v4_path), engine(v4_path)
    prefill.add_request("r", list(range(3, 26)), SamplingParams(max_tokens=1), keep_kv=True)
    run_to_completion(prefill)
    export = prefill.export_kv("r")
    assert decode.begin_kv_import(
        "r", export.prompt_token_ids, export.output_token_ids, SamplingParams(), export.layout, export.num_tokens
    )
    chunks = list(export.chunks())
    with pytest.raises(KVLayoutError, match="section has 10 bytes"):
        decode.import_kv_chunk("r", 1, b"\0" * 10)
    for chunk in chunks[:-1]:
        decode.import_kv_chunk("r", chunk.layer, chunk.data)
    with pytest.raises(KVLayoutError, match=r"lacks layers \[3\]"):
        decode.finish_kv_import("r")
    assert decode.abort_request("r") and decode.runner.sequence_states == {}


def test_blocks_streamed_in_layer_by_layer_give_a_cold_runs_tokens(v4_path):
    """A V4 prefix hit rebuilds the request's state from its blocks' rows before the forward pass, so a step that
    reads blocks still arriving from a KV store (engine_core.kv_load) first waits for all of their layers."""
    prompt = [(i * 37) % 480 + 3 for i in range(70)]  # 4 full blocks of 16, then 6 tokens
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold = engine(v4_path, served_name="m")
    cold.add_request("cold", prompt, greedy)
    expected = run_to_completion(cold)["cold"]
    keys = cold.prompt_block_hashes(prompt)
    blocks, layout = cold.read_cached_blocks(keys), cold.kv_layout
    offsets = layout.layer_offsets()  # block format 2: layers differ in size
    warm = engine(v4_path, served_name="m")
    load = warm.loads.begin(root_hash("m"), keys, prompt[: 16 * len(keys)])
    warm.add_request("warm", prompt, greedy)

    def loader() -> None:  # the layers arrive after the step has started
        for layer in range(layout.num_layers):
            time.sleep(0.2)
            warm.loads.write_layer(load, layer, [block[offsets[layer] : offsets[layer + 1]] for block in blocks])  # type: ignore[index]

    thread = threading.Thread(target=loader)
    thread.start()
    tokens = run_to_completion(warm)["warm"]
    thread.join()
    assert tokens == expected
    assert warm.stats().num_prefix_hit_tokens == 64
