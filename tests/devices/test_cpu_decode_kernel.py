"""The cpu module's C++ attention kernels (devices/csrc/paged_decode.cpp), built here: they read each sequence's
blocks in place and must give what the gather + SDPA (or GEMMs) path gives: decode row by row, whatever else is
in the batch, and a chunk of a prompt over its cached context."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import cpp_extension

from devices.cpu import CHUNK_KERNEL_MAX_ROWS, CpuOps
from devices.cpu_kernels import (
    SOURCE_DIR,
    SOURCES,
    build_name,
    chunk_kernel_pays,
    paged_chunk_kernel,
    paged_decode_kernel,
)
from engine_core import LLM, SamplingParams
from engine_core.config import ConfigError, EngineConfig
from engine_core.engine import uses_cpu_decode_kernel
from tests.devices.test_cpu_decode import BLOCK_SIZE, LENGTHS, _tables


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    ops = CpuOps()
    assert ops.use_decode_kernel(), "the kernel did not build (g++ and ninja are part of the test environment)"
    assert (ops.chunk_kernel is not None) is chunk_kernel_pays()
    ops.chunk_kernel = paged_chunk_kernel()  # tested on every host, though the engine takes it on AVX-512 only
    return ops


@pytest.mark.parametrize("context_lens", [*LENGTHS, [300, 17, 129]])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 64), (4, 4, 64), (9, 3, 64), (10, 2, 128), (4, 2, 8)]
)
def test_the_kernel_gives_what_gather_and_sdpa_give(
    ops: CpuOps, context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Head sizes of 16-float multiples take the vector path where the CPU has AVX-512 (10 heads over 2 KV heads:
    value sums of 4, 4 and 2 heads at a time; 128 floats: two passes of 64), others the scalar loops."""
    gen = torch.Generator().manual_seed(3)
    num_blocks = 128
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    tables, _ = _tables(context_lens, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    plain = CpuOps()
    expected = plain.paged_decode_attention(q, k_cache, v_cache, plain.prepare_decode(tables, lens, BLOCK_SIZE), 0.125)
    batch = ops.prepare_decode(tables, lens, BLOCK_SIZE)
    out = ops.paged_decode_attention(q, k_cache, v_cache, batch, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for row in range(len(context_lens)):  # a row alone: the same bits as in the batch
        alone = ops.prepare_decode(tables[row : row + 1], lens[row : row + 1], BLOCK_SIZE)
        assert torch.equal(ops.paged_decode_attention(q[row : row + 1], k_cache, v_cache, alone, 0.125)[0], out[row])


@pytest.mark.parametrize("context_lens", LENGTHS)
def test_mla_reads_the_latent_cache_in_place_and_gives_what_the_gather_gives(
    ops: CpuOps, context_lens: list[int]
) -> None:
    """MLA's latent cache is both the keys (latent and rope parts) and the values (the latent part alone)."""
    gen = torch.Generator().manual_seed(5)
    num_heads, rank, rope_dims, num_blocks = 4, 32, 16, 64
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope_dims, generator=gen)
    q_latent = torch.randn(len(context_lens), num_heads, rank, generator=gen)
    q_rope = torch.randn(len(context_lens), num_heads, rope_dims, generator=gen)
    tables, _ = _tables(context_lens, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    plain = CpuOps()
    plain_batch = plain.prepare_decode(tables, lens, BLOCK_SIZE)
    expected = plain.mla_decode_attention(q_latent, q_rope, kv_cache, plain_batch, 0.2)
    out = ops.mla_decode_attention(q_latent, q_rope, kv_cache, ops.prepare_decode(tables, lens, BLOCK_SIZE), 0.2)
    assert out.shape == (len(context_lens), num_heads, rank)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for row in range(len(context_lens)):  # a row alone: the same bits as in the batch
        alone = ops.prepare_decode(tables[row : row + 1], lens[row : row + 1], BLOCK_SIZE)
        got = ops.mla_decode_attention(q_latent[row : row + 1], q_rope[row : row + 1], kv_cache, alone, 0.2)
        assert torch.equal(got[0], out[row])


def test_a_value_wider_than_its_row_is_refused(ops: CpuOps) -> None:
    kernel = paged_decode_kernel()
    assert kernel is not None
    cache = torch.randn(4, BLOCK_SIZE, 1, 8)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head shapes"):
        kernel(torch.randn(1, 2, 8), cache, cache, tables, lens, 1.0, 9)


def test_int64_tables_are_taken_and_a_length_past_the_table_is_refused(ops: CpuOps) -> None:
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    v_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    q = torch.randn(1, 4, 16, generator=gen)
    tables = torch.tensor([[3, 5]])
    batch = ops.prepare_decode(tables, torch.tensor([6]), BLOCK_SIZE)  # int64, as a caller might pass them
    plain = CpuOps()
    plain_batch = plain.prepare_decode(tables, torch.tensor([6]), BLOCK_SIZE)
    expected = plain.paged_decode_attention(q, k_cache, v_cache, plain_batch, 1.0)
    torch.testing.assert_close(ops.paged_decode_attention(q, k_cache, v_cache, batch, 1.0), expected)
    kernel = paged_decode_kernel()
    assert kernel is not None
    with pytest.raises(RuntimeError, match="context length outside its block table"):
        kernel(q, k_cache, v_cache, tables.int(), torch.tensor([9], dtype=torch.int32), 1.0)


@pytest.mark.parametrize(
    ("num_cached", "num_new"), [(0, 1), (0, 7), (5, 3), (16, 16), (37, 12), (300, 8), (1001, 1), (700, 32)]
)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "head_dim"), [(9, 3, 16, 64), (4, 4, 4, 128), (6, 2, 32, 32)]
)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_chunk_over_its_paged_context_gives_what_the_gather_gives(
    ops: CpuOps,
    num_cached: int,
    num_new: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    threads: int,
) -> None:
    """The chunk kernel: every query sees the cached context and the chunk's tokens up to its own, through a
    shuffled block table; split into one partition a thread (3 threads: merged partial softmaxes)."""
    gen = torch.Generator().manual_seed(num_cached + num_new)
    num_total = num_cached + num_new
    num_blocks = -(-num_total // block_size) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_new, num_heads, head_dim, generator=gen)
    block_ids = torch.randperm(num_blocks, generator=gen)[: -(-num_total // block_size)]
    expected = CpuOps().cached_prefill_attention(q, k_cache, v_cache, block_ids, num_cached, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.cached_prefill_attention(q, k_cache, v_cache, block_ids, num_cached, 0.125)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (num_new, num_heads, head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_the_chunk_kernel_refuses_what_it_cannot_do_and_larger_chunks_take_the_gather(ops: CpuOps) -> None:
    kernel = paged_chunk_kernel()
    assert kernel is not None
    cache = torch.randn(4, BLOCK_SIZE, 2, 64)
    with pytest.raises(RuntimeError, match="context length outside its block table"):
        kernel(torch.randn(3, 4, 64), cache, cache, torch.tensor([1, 2], dtype=torch.int32), 6, 1.0)  # 9 > 8
    with pytest.raises(RuntimeError, match="values of 16, 32, 64 or 128 floats"):
        kernel(torch.randn(3, 4, 64), cache, cache, torch.tensor([1, 2], dtype=torch.int32), 1, 1.0, 48)
    with pytest.raises(RuntimeError, match="at most 128 query rows a KV head"):
        kernel(torch.randn(65, 4, 64), cache, cache, torch.tensor([1], dtype=torch.int32), 0, 1.0)
    calls = []
    real = ops.chunk_kernel
    ops.chunk_kernel = lambda *args: calls.append(args[0].shape[0]) or real(*args)  # type: ignore[misc]
    big = torch.randn(40, BLOCK_SIZE, 2, 64)
    try:
        for num_new in (CHUNK_KERNEL_MAX_ROWS // 2, CHUNK_KERNEL_MAX_ROWS // 2 + 1):  # 2 query heads a KV head
            q = torch.randn(num_new, 4, 64)
            ops.cached_prefill_attention(q, big, big, torch.arange(40), 10, 1.0)
    finally:
        ops.chunk_kernel = real
    assert calls == [CHUNK_KERNEL_MAX_ROWS // 2]


def test_the_chunk_kernel_is_taken_where_the_cpu_has_avx512() -> None:
    assert chunk_kernel_pays() is (torch.backends.cpu.get_cpu_capability() == "AVX512")
    ops = CpuOps()
    assert ops.use_decode_kernel()
    assert (ops.chunk_kernel is not None) is chunk_kernel_pays()


def test_the_build_is_named_after_the_sources_and_this_cpu() -> None:
    name = build_name()
    assert name.startswith("kvmesh_cpu_kernels_") and len(name) == len("kvmesh_cpu_kernels_") + 16
    assert build_name() == name
    assert sorted(path.name for path in SOURCE_DIR.iterdir()) == sorted([*SOURCES, "kernels.h"])  # all hashed


@pytest.mark.parametrize("reference", ["llama_reference", "deepseek_reference"])
def test_the_engine_decodes_the_same_tokens_with_the_kernel(reference: str, request: pytest.FixtureRequest) -> None:
    """Llama's grouped-query attention and DeepSeek-V3's MLA (its latent cache) by the kernel: the engine's greedy
    tokens as without it."""
    path = str(request.getfixturevalue(reference)[0])
    prompts = [[1, 5, 9, 2, 7, 3, 8, 4, 6, 10, 11, 12, 13, 14, 15, 16, 17], [4, 4, 2]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    chunks: list[tuple[int, int]] = []

    def counted(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: Any) -> torch.Tensor:
            chunks.append((args[0].shape[0], args[4]))  # (new tokens, cached)
            return kernel(*args)

        return call

    for on in (False, True):
        # 6 tokens a step: the 17-token prompt is prefilled in chunks after the first, over its cached context
        llm = LLM(path, device="cpu", num_kv_blocks=32, block_size=4, cpu_decode_kernel=on, max_num_batched_tokens=6)
        ops = llm.engine.ops
        assert (ops.decode_kernel is not None) is on
        if on:  # the chunk kernel too, even where the engine leaves it off (AVX2: chunk_kernel_pays)
            kernel = paged_chunk_kernel()
            assert kernel is not None
            ops.chunk_kernel = counted(kernel)
        outputs[on] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
    assert [len(ids) for ids in outputs[True]] == [24, 24]
    if reference == "llama_reference":  # MLA's prefill does not take the chunk kernel
        # (new tokens, cached): the 17-token prompt in 6 + 6 + 5, the 3-token one in 1 + 2; each once a layer
        assert sorted(set(chunks)) == [(2, 1), (5, 12), (6, 6)]
        assert len(chunks) == 3 * llm.engine.model_config.num_layers


def test_the_setting_takes_only_a_boolean() -> None:
    with pytest.raises(ConfigError, match="cpu_decode_kernel must be true or false"):
        EngineConfig(model="smollm2-135m", cpu_decode_kernel="yes")  # type: ignore[arg-type]


def test_without_a_compiler_the_gather_path_serves(tmp_path) -> None:
    """Where the kernel cannot be built (the compose image has no g++), use_decode_kernel says so and the cpu
    module keeps gathering blocks for SDPA: a warning, not a failed start."""
    script = "from devices.cpu import CpuOps\nops = CpuOps()\nprint(ops.use_decode_kernel(), ops.decode_kernel)\n"
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "False None"
    assert "cpu kernels unavailable" in result.stdout + result.stderr


def test_a_build_lock_left_by_a_dead_builder_does_not_stop_the_next(tmp_path) -> None:
    """torch's build lock is a file its waiters poll until it is gone; one left by a process killed mid-build
    would make every later process wait forever. The kernel's own flock shows nobody is building: the leftover
    is removed, with a warning, and the kernel loads. The extension directory is a copy of the suite's built one
    (timestamps kept, so torch's ninja finds nothing to do): the lock is what is tested, not a second build of the
    kernel, which took 20 s on an idle machine and 180 s on a slow one beside the other test worker."""
    assert paged_decode_kernel() is not None  # built in the suite's extension directory (`make install` did it)
    name = build_name()
    built = Path(cpp_extension._get_build_directory(name, verbose=False))
    copy = tmp_path / name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "kvmesh.flock"))
    (copy / "lock").touch()  # what a builder killed mid-build leaves
    script = "from devices.cpu_kernels import paged_decode_kernel\nprint(paged_decode_kernel() is not None)\n"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "True"
    assert "removing a build lock left by a process that died building it" in result.stdout + result.stderr
    assert not (copy / "lock").exists()
    objects = sorted(p.name for p in copy.glob("*.o"))
    assert objects == ["int8_linear.o", "module.o", "paged_decode.o"]  # and nothing was compiled again:
    for obj in objects:
        assert (copy / obj).stat().st_mtime_ns == (built / obj).stat().st_mtime_ns


def test_the_engine_turns_it_on_only_for_the_cpu_family_at_float32() -> None:
    """The cuda and ascend modules inherit CpuOps; their tensors are not the kernel's, so it stays off there."""

    class OtherFamily(CpuOps):
        name = "ascend"

    other, half = OtherFamily(), CpuOps()
    assert not uses_cpu_decode_kernel(other, torch.float32) and other.decode_kernel is None
    assert not uses_cpu_decode_kernel(half, torch.bfloat16) and half.decode_kernel is None
    cpu = CpuOps()
    assert uses_cpu_decode_kernel(cpu, torch.float32) and cpu.decode_kernel is not None
