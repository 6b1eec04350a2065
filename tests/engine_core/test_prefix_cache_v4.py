"""DeepSeek-V4's prefix cache and memory budget: a hit resumes exactly where a cold run is, and the paged cache plus
the state pools (one slot per running request) never exceed kv_cache_memory_bytes.

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
from engine_core.models.deepseek_v4.paged_pools import PagedPools, block_bytes
from engine_core.models.deepseek_v4.pools import bytes_per_slot
from engine_core.models.deepseek_v4.shapes import V4_FLASH
from engine_core.models.deepseek_v4.state import CompressorState, SequenceState, bytes_per_sequence
from tests.engine_core.test_engine import handoff
from tests.engine_core.test_parity import random_prompts
from tests.engine_core.v4_helpers import SMALL_V4_CONFIG, write_small_v4

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
SMALL_V4 = ModelConfig.from_hf(SMALL_V4_CONFIG)


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
    pools = model.new_kv_cache(3, 8)
    assert {pool: tuple(tensor.shape) for pool, tensor in pools.tensors.items()} == {
        "window": (4, 3, 8 * 32),  # every layer: 8 window vectors
        "csa": (2, 3, 2 * 32 + 2 * 4 * 32 + 2 * 16 + 2 * 4 * 16),  # 2 entries, overlaps; 2 indexer keys, overlaps
        "hca": (1, 3, 1 * 32),  # 1 entry
    }
    with pytest.raises(ValueError, match="block_size 12"):
        model.new_kv_cache(3, 12)


def test_the_memory_budget_holds_the_state_pools_too(v4_path):
    """kv_cache_memory_bytes bounds the paged cache plus the preallocated state pools: at most half the budget goes
    to state slots (max_num_seqs shrinks to the slots), the rest to blocks; under a load of mixed lengths that
    preempts, every request holding blocks holds exactly one slot and nothing else is allocated."""
    path = v4_path
    budget = 400_000
    engine = LLMEngine(EngineConfig(str(path), device="cpu", kv_cache_memory_bytes=budget))
    slot = engine.runner.model.state_slot_bytes()  # type: ignore[operator]
    assert slot == 13_056  # see the arithmetic in docs/engine.md
    assert engine.max_num_seqs == engine.kv.num_state_slots == budget // 2 // slot == 15
    v4, state_pools = SMALL_V4.v4, engine.runner.pools
    assert v4 is not None and state_pools is not None
    state_bytes = {name: t.numel() * t.element_size() for name, t in state_pools.tensors.items()}
    assert state_bytes == {name: 15 * size for name, size in bytes_per_slot(v4, 4).items()}
    assert engine.runner.state_pool_bytes == 15 * slot
    # a block of 16 tokens in fp32, pool by pool: every layer's window vectors; 2 CSA layers' 4 entries, overlaps,
    # 4 indexer keys and overlaps; 1 HCA layer's 2 entries (block format 2's 13,056 bytes, nothing padded)
    per_block = {
        "window": 4 * 16 * 32 * 4,
        "csa": 2 * (4 * 32 + 2 * 4 * 32 + 4 * 16 + 2 * 4 * 16) * 4,
        "hca": 1 * 2 * 32 * 4,
    }
    assert engine.runner.model.kv_block_bytes(16) == per_block  # type: ignore[operator]
    bytes_per_block = sum(per_block.values())
    assert bytes_per_block == engine.kv_layout.num_block_bytes == 13_056
    # 11 when every layer's row was as wide as a CSA layer's (17,408 B a block), 10 when entries were held twice
    assert engine.kv.num_blocks == (budget - 15 * slot) // bytes_per_block == 15
    assert engine.runner.kv_caches.bytes_by_pool == {pool: 15 * size for pool, size in per_block.items()}  # type: ignore[union-attr]
    assert engine.runner.kv_cache_bytes + engine.runner.state_pool_bytes == 15 * bytes_per_block + 15 * slot <= budget
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(512, (20, 45, 7, 60, 33, 12, 50, 26))):
        engine.add_request(f"r{i}", prompt, params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = [r.request_id for r in engine.scheduler.running]
        slots = sorted(engine.kv.state_slot(request_id) for request_id in running)
        assert len(set(slots)) == len(slots) and all(0 <= s < 15 for s in slots)
        assert engine.kv.num_free_state_slots == 15 - len(running)
        most = max(most, len(running))
    assert engine.stats().num_preemptions > 0 and most > 1
    engine.runner.drop_finished_states()  # as the next step would
    assert engine.kv.num_free_state_slots == 15 and engine.runner.sequence_states == {}
    with pytest.raises(ConfigError, match="holds no request"):
        LLMEngine(EngineConfig(str(path), device="cpu", kv_cache_memory_bytes=2 * slot - 1))


def test_admission_waits_for_a_free_state_slot(v4_path):
    """Two slots: a finished request kept for KV export holds its slot until released, so of two new requests
    one runs and one waits although the batch has room; a preempted request gives its slot back."""
    engine = LLMEngine(EngineConfig(str(v4_path), device="cpu", num_kv_blocks=64, max_num_seqs=2))
    assert (engine.kv.num_state_slots, engine.runner.state_pool_bytes) == (2, 2 * 13_056)
    prompt = random_prompts(512, (20,))[0]
    engine.add_request("kept", prompt, SamplingParams(max_tokens=1), keep_kv=True)
    engine.step()
    assert engine.kv.state_slot("kept") == 0 and engine.kv.num_free_state_slots == 1
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, engine.kv.num_free_state_slots) == (1, 1, 0)
    assert engine.kv.state_slot("a") == 1 and engine.kv.state_slot("b") == -1
    engine.release("kept")
    engine.step()
    assert engine.kv.state_slot("b") == 0 and engine.stats().num_waiting == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_state_slots == 2

    tight = LLMEngine(EngineConfig(str(v4_path), device="cpu", num_kv_blocks=6, block_size=8, max_num_seqs=2))
    for i, prompt in enumerate(random_prompts(512, (14, 15))):
        tight.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    seen = set()
    while tight.has_unfinished_requests():
        tight.step()
        holding = {r: tight.kv.state_slot(r) for r in ("r0", "r1")}
        seen.add(tuple(sorted(holding.items())))
        assert tight.kv.num_free_state_slots == sum(1 for s in holding.values() if s < 0)
    assert tight.stats().num_preemptions == 1
    assert (("r0", 0), ("r1", -1)) in seen  # r1 preempted: its slot is free while it waits


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
    widths = {layout.row_width for layout in layouts}  # a layer's elements per block, all its pools
    assert widths == {128 * 512, 128 * 512 + 512, 128 * 512 + 32 * 512 + 8 * 512 + 32 * 128 + 8 * 128}
    assert sum(layout.row_width for layout in layouts) * 2 // 128 == 52_592
    assert len(layouts) * max(widths) * 2 // 128 == 61_232  # one tensor, every layer as wide as a CSA layer
    assert block_bytes(layouts, 2) == {  # the paged pools: exactly the sections, 52,592 B per token
        "window": 43 * 128 * 512 * 2,
        "csa": 21 * (32 * 512 + 8 * 512 + 32 * 128 + 8 * 128) * 2,
        "hca": 20 * 512 * 2,
    }
    assert sum(block_bytes(layouts, 2).values()) == 52_592 * 128 == 6_731_776


def test_v4_flash_state_slot():
    """docs/engine.md's bytes of one V4-Flash state slot in bf16, pool by pool: the window of every layer, CSA's open
    windows (two series, kv and gates) and kept half-windows (gates in fp32) for the compressor and the indexer, HCA's
    open windows; the same total as state.bytes_per_sequence summed over the layers."""
    config = ModelConfig.from_hf(V4_FLASH)
    v4 = config.v4
    assert v4 is not None
    per_pool = bytes_per_slot(v4, 2)
    assert per_pool == {
        "window": 43 * 127 * 512 * 2,
        "csa.tail_kv": 21 * 3 * 1024 * 2,
        "csa.tail_gate": 21 * 3 * 1024 * 2,
        "csa.overlap_kv": 21 * 4 * 512 * 2,
        "csa.overlap_gate": 21 * 4 * 512 * 4,
        "csa.index_tail_kv": 21 * 3 * 256 * 2,
        "csa.index_tail_gate": 21 * 3 * 256 * 2,
        "csa.index_overlap_kv": 21 * 4 * 128 * 2,
        "csa.index_overlap_gate": 21 * 4 * 128 * 4,
        "hca.tail_kv": 20 * 127 * 512 * 2,
        "hca.tail_gate": 20 * 127 * 512 * 2,
    }
    per_sequence = bytes_per_sequence(v4, 2)
    assert sum(per_pool.values()) == sum(per_sequence[kind] for kind in v4.attention_types) == 11_439_104


def test_a_block_in_the_pools_is_block_format_2():
    """A block's bytes are its layers' sections back to back (each layer's window row, then its kind's row), so a
    block read from one set of pools and written, whole or layer by layer, into another lands where it was."""
    v4 = SMALL_V4.v4
    assert v4 is not None
    layouts = [BlockLayout.of_layer(v4, layer, 8) for layer in range(4)]
    source = PagedPools(layouts, 3, torch.float32, torch.device("cpu"))
    for tensor in source.tensors.values():
        tensor.copy_(torch.randn(tensor.shape))
    rows = [source.layer(layer) for layer in range(4)]
    expected = [rows[0]["window"][1], rows[1]["window"][1], rows[1]["csa"][1], rows[2]["window"][1]]
    expected += [rows[2]["hca"][1], rows[3]["window"][1], rows[3]["csa"][1]]
    block = source.read_block(1)
    assert torch.equal(block, torch.cat(expected))
    assert block.numel() == 4 * 8 * 32 + 2 * (2 * 32 + 2 * 4 * 32 + 2 * 16 + 2 * 4 * 16) + 32 == 2_016
    whole, by_layer = (PagedPools(layouts, 3, torch.float32, torch.device("cpu")) for _ in range(2))
    whole.write_block(2, block)
    offset = 0
    for layer, layout in enumerate(layouts):
        by_layer.write_layer(layer, [0], block[offset : offset + layout.row_width][None])
        offset += layout.row_width
    for pool, tensor in source.tensors.items():
        assert torch.equal(whole.tensors[pool][:, 2], tensor[:, 1]) and not whole.tensors[pool][:, :2].any()
        assert torch.equal(by_layer.tensors[pool][:, 0], tensor[:, 1])
