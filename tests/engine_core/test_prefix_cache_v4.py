"""DeepSeek-V4's prefix cache and memory budget: a hit resumes exactly where a cold run is, and the paged cache plus
the running requests' states never exceed kv_cache_memory_bytes.

The model is a small random V4 with every layer type (v4_helpers: window 8, CSA ratio 4, HCA ratio 8): blocks of 8
tokens close two CSA windows and one HCA window each, and the sliding window (7 kept tokens) spans a block boundary.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine_core import LLM, SamplingParams
from engine_core.config import ConfigError, EngineConfig, ModelConfig
from engine_core.engine import LLMEngine
from engine_core.kv_cache.block_hash import root_hash
from engine_core.models.deepseek_v4.block_layout import BlockLayout
from engine_core.models.deepseek_v4.shapes import V4_FLASH
from engine_core.models.deepseek_v4.state import CompressorState, SequenceState
from tests.engine_core.test_engine import handoff
from tests.engine_core.test_parity import random_prompts
from tests.engine_core.v4_helpers import write_small_v4

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory: pytest.TempPathFactory):
    return write_small_v4(tmp_path_factory.mktemp("v4-prefix"))


def assert_same_state(rebuilt: SequenceState, live: SequenceState) -> None:
    """Bit for bit: every tensor of every layer, dtypes and shapes included."""
    assert rebuilt.num_tokens == live.num_tokens
    for ours, theirs in zip(rebuilt.layers, live.layers, strict=True):
        assert ours.window.dtype == theirs.window.dtype and torch.equal(ours.window, theirs.window)
        for a, b in ((ours.compressor, theirs.compressor), (ours.indexer, theirs.indexer)):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert_same_compressor(a, b)


def assert_same_compressor(a: CompressorState, b: CompressorState) -> None:
    for name in ("tail_kv", "tail_gate", "entries", "overlap_kv", "overlap_gate"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("chunk", [8, 3])
def test_blocks_rebuild_the_live_state_at_every_boundary(v4_path, chunk):
    """Prefill 40 tokens in chunks of 8 (one block a step) or 3 (chunks splitting windows and blocks); whenever
    the computed tokens reach a block boundary, the state rebuilt from the blocks equals the live one."""
    path = v4_path
    llm = LLM(str(path), device="cpu", num_kv_blocks=16, block_size=8, max_num_batched_tokens=chunk)
    engine = llm.engine
    prompt = random_prompts(512, (40,))[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    snapshots: dict[int, SequenceState] = {}
    while engine.has_unfinished_requests():
        engine.step()
        if "r" in engine.runner.sequence_states:
            state = engine.runner.sequence_states["r"][1]
            if state.num_tokens % 8 == 0:
                snapshots[state.num_tokens] = copy.deepcopy(state)
    assert sorted(snapshots) == ([8, 16, 24, 32, 40] if chunk == 8 else [24, 40])  # 3-token chunks: 24 and 40
    model, caches = engine.runner.model, engine.runner.kv_caches
    cached = [engine.kv.pool.get_cached_block(h) for h in engine.prompt_block_hashes(prompt)]
    block_ids = [block.block_id for block in cached if block is not None]
    assert len(block_ids) == 5  # the finished request's blocks, still in the prefix cache
    for num_tokens, live in snapshots.items():
        assert_same_state(model.sequence_state_from_blocks(caches, block_ids[: num_tokens // 8], 8), live)


def test_a_hit_gives_the_tokens_of_a_cold_run(v4_path):
    """A batch of mixed lengths over a shared 24-token prefix (3 blocks of 8): suffixes of 1, 3, 7 and 13 tokens
    end inside a CSA window, inside an HCA window, and across both; one prompt shares nothing. Greedy tokens equal
    a cold run's, and top-5 logprobs agree to float rounding (a hit computes fewer rows per step)."""
    path = v4_path
    prefix = random_prompts(512, (24,))[0]
    tails = random_prompts(500, (1, 3, 7, 13, 30))
    prompts = [prefix + tail for tail in tails[:4]] + [tails[4]]
    cold = LLM(str(path), device="cpu", num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    expected = cold.generate(prompts, PARAMS)
    warm = LLM(str(path), device="cpu", num_kv_blocks=64, block_size=8)
    warm.generate([[*prefix, 7, 7, 7]], PARAMS)  # caches the prefix's 3 blocks
    got = warm.generate(prompts, PARAMS)
    assert [o.num_cached_tokens for o in got] == [24, 24, 24, 24, 0]
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            torch.testing.assert_close(torch.tensor([v for _, v in a.top]), torch.tensor([v for _, v in b.top]))
    assert warm.engine.stats().num_prefix_hit_tokens == 4 * 24


def test_preemption_resumes_from_cached_blocks(v4_path):
    """With 6 blocks of 8 tokens two requests of 14 and 15 start (2 blocks each) but cannot both grow to 30: the
    later one is preempted and, back in, restarts from its cached blocks (a rebuilt state) instead of its first
    token; no token changes."""
    path = v4_path
    prompts = random_prompts(512, (14, 15))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = [o.token_ids for o in LLM(str(path), device="cpu", num_kv_blocks=64).generate(prompts, params)]
    tight = LLM(str(path), device="cpu", num_kv_blocks=6, block_size=8)
    assert [o.token_ids for o in tight.generate(prompts, params)] == roomy
    stats = tight.engine.stats()
    assert stats.num_preemptions == 1
    assert stats.num_prompt_tokens_computed == 14 + 15  # back in, the preempted one hit its prompt's blocks


def test_blocks_read_from_one_engine_serve_as_hits_in_another(v4_path):
    """The store's path (read_cached_blocks -> inject_cached_blocks) carries V4 blocks: a hit on injected blocks
    gives the source's tokens."""
    path = v4_path
    prompt = random_prompts(512, (45,))[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    source = LLM(str(path), device="cpu", num_kv_blocks=32, served_name="m")
    expected = source.generate([prompt], params)[0].token_ids
    hashes = source.engine.prompt_block_hashes(prompt)
    assert len(hashes) == 2 and source.engine.num_cached_blocks(hashes) == 2
    target = LLM(str(path), device="cpu", num_kv_blocks=32, served_name="m")
    data = source.engine.read_cached_blocks(hashes)
    # block format 2: each layer's sections (window 512, CSA 1088, HCA 576, CSA 1088 floats), not 4 rows of 1088
    assert [len(block) for block in data] == [source.engine.kv_layout.num_block_bytes] * 2 == [13_056] * 2  # type: ignore[arg-type]
    assert target.engine.inject_cached_blocks(root_hash("m"), hashes, prompt[:32], data) == 2  # type: ignore[arg-type]
    out = target.generate([prompt], params)[0]
    assert out.num_cached_tokens == 32 and out.token_ids == expected


def test_block_size_is_a_multiple_of_every_compress_ratio(v4_path):
    path = v4_path
    assert LLM(str(path), device="cpu", num_kv_blocks=8, block_size=6).engine.config.block_size == 8
    assert LLM(str(path), device="cpu", num_kv_blocks=8, block_size=16).engine.config.block_size == 16
    model = LLM(str(path), device="cpu", num_kv_blocks=8, block_size=8).engine.runner.model
    assert model.kv_cache_shape(3, 8) == (3, 8 * 32 + 2 * 32 + 2 * 4 * 32 + 2 * 16 + 2 * 4 * 16)  # a CSA row
    with pytest.raises(ValueError, match="block_size 12"):
        model.kv_cache_shape(3, 12)


def test_the_memory_budget_holds_the_states_too(v4_path):
    """kv_cache_memory_bytes bounds the paged cache plus every live sequence state, under a load of mixed
    lengths that preempts; the running requests' fixed state takes at most half the budget (max_num_seqs shrinks)."""
    path = v4_path
    budget = 400_000
    engine = LLMEngine(EngineConfig(str(path), device="cpu", kv_cache_memory_bytes=budget))
    fixed, per_block = engine.runner.model.sequence_state_bytes(16)
    assert (fixed, per_block) == (13_056, 1_792)  # see the arithmetic in docs/engine.md
    assert engine.max_num_seqs == budget // 2 // fixed == 15
    row_bytes = 4 * (16 * 32 + 4 * 32 + 2 * 4 * 32 + 4 * 16 + 2 * 4 * 16) * 4  # layers * CSA row * fp32
    assert engine.kv.num_blocks == (budget - 15 * fixed) // (row_bytes + per_block) == 10
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(512, (20, 45, 7, 60, 33, 12, 50, 26))):
        engine.add_request(f"r{i}", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        states = [state for _, state in engine.runner.sequence_states.values()]
        used = engine.runner.kv_cache_bytes + sum(state.num_bytes for state in states)
        peak = max(peak, used)
        assert used <= budget
    assert engine.stats().num_preemptions > 0 and peak > engine.runner.kv_cache_bytes
    with pytest.raises(ConfigError, match="holds no request"):
        LLMEngine(EngineConfig(str(path), device="cpu", kv_cache_memory_bytes=2 * fixed - 1))


def test_an_imported_state_is_never_a_prefix_hit(v4_path):
    """A handoff carries the request's state, not its blocks' rows: the decode engine never offers those blocks to
    a later request with the same prompt, which computes it and gets the same tokens."""
    prompt = random_prompts(512, (40,))[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prefill = LLMEngine(EngineConfig(str(v4_path), device="cpu", num_kv_blocks=32, block_size=8))
    decode = LLM(str(v4_path), device="cpu", num_kv_blocks=32, block_size=8)
    handed_off = handoff(prefill, decode.engine, "r", prompt, params)
    again = decode.generate([prompt], params)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == handed_off


def test_v4_flash_block_rows():
    """docs/engine.md's bytes per cached token for V4-Flash's shape in bf16, blocks of 128: a CSA row holds 128
    window vectors, 32 entries + 32 indexer keys and the two overlaps; HCA one entry; window-only layers only
    vectors."""
    config = ModelConfig.from_hf(V4_FLASH)
    assert config.v4 is not None
    layouts = [BlockLayout.of_layer(config.v4, layer, 128) for layer in range(config.num_layers)]
    widths = {layout.row_width for layout in layouts}
    assert widths == {128 * 512, 128 * 512 + 512, 128 * 512 + 32 * 512 + 8 * 512 + 32 * 128 + 8 * 128}
    assert sum(layout.row_width for layout in layouts) * 2 // 128 == 52_592
    assert len(layouts) * max(widths) * 2 // 128 == 61_232
