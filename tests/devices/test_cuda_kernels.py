"""The cuda module's Triton kernels against the cpu reference, on random inputs (fp32).

Without a GPU the kernels run in Triton's interpreter (see conftest.py), which is slow: shapes stay small.
The interpreter rounds fp32 -> bf16 by truncation and cannot tl.dot bf16 tensors, so bf16 is left to
bench/gpu_check.py on a real GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from devices.base import DecodeBatch
from devices.cpu import CpuOps
from devices.cuda import (
    CudaOps,
    attention,
    moe,
)
from devices.cuda.configs import BLACKWELL, HOPPER, LaunchConfig, get_config

MoeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def ops(torch_device: torch.device) -> CudaOps:
    return CudaOps(torch_device)


@pytest.fixture(scope="module")
def ref(torch_device: torch.device) -> CpuOps:
    return CpuOps(torch_device)


def randn(*shape: int, device: torch.device, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device)


def block_tables(context_lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """(B, M) int32: distinct block ids in shuffled order, so neighbours in a sequence are far apart in the cache."""
    max_blocks = max(-(-n // block_size) for n in context_lens)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen)[: len(context_lens) * max_blocks]
    return ids.view(len(context_lens), max_blocks).int()


def decode_batches(ops: CudaOps, ref: CpuOps, context_lens: list[int], block_size: int, num_blocks: int,
                   device: torch.device) -> tuple[DecodeBatch, DecodeBatch]:  # fmt: skip
    tables = block_tables(context_lens, block_size, num_blocks).to(device)  # (B, M)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)  # (B,)
    return ops.prepare_decode(tables, lens, block_size), ref.prepare_decode(tables, lens, block_size)


# -- norms -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 96), (3, 576)])
def test_rms_norm(ops: CudaOps, ref: CpuOps, torch_device: torch.device, num_tokens: int, hidden: int) -> None:
    x = randn(num_tokens, hidden, device=torch_device, scale=3.0)
    weight = randn(hidden, device=torch_device, seed=1)
    assert_close(ops.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))


def test_rms_norm_eps_dominates_small_rows(ops: CudaOps, ref: CpuOps, torch_device: torch.device) -> None:
    x = randn(4, 64, device=torch_device, scale=1e-3)  # mean square 1e-6, below eps
    weight = randn(64, device=torch_device, seed=1)
    assert_close(ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))


def test_rms_norm_strided_rows(ops: CudaOps, ref: CpuOps, torch_device: torch.device) -> None:
    x = randn(5, 160, device=torch_device)[:, 16:144]  # rows 160 apart
    weight = randn(128, device=torch_device, seed=1)
    assert_close(ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("num_tokens, inter", [(1, 32), (9, 100), (2, 1100)])  # 1100 spans two column blocks
def test_silu_and_mul(ops: CudaOps, ref: CpuOps, torch_device: torch.device, num_tokens: int, inter: int) -> None:
    x = randn(num_tokens, 2 * inter, device=torch_device, scale=4.0)
    out = ops.silu_and_mul(x)
    assert out.shape == (num_tokens, inter)
    assert_close(out, ref.silu_and_mul(x))


# -- GQA decode ---------------------------------------------------------------------------------------------------

CONTEXTS = {
    "shorter_than_a_block": [5, 11],
    "exactly_a_block": [16, 16],
    "many_blocks": [1, 77, 200, 129],
}


@pytest.mark.parametrize("contexts", CONTEXTS.values(), ids=CONTEXTS.keys())
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (4, 4, 32)], ids=["gqa3", "mha"])
def test_paged_decode_attention(ops: CudaOps, ref: CpuOps, torch_device: torch.device, contexts: list[int],
                                num_heads: int, num_kv_heads: int, head_size: int) -> None:  # fmt: skip
    block_size, num_blocks = 16, 64
    batch, ref_batch = decode_batches(ops, ref, contexts, block_size, num_blocks, torch_device)
    q = randn(len(contexts), num_heads, head_size, device=torch_device)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_size, device=torch_device, seed=1)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_size, device=torch_device, seed=2)
    out = ops.paged_decode_attention(q, k_cache, v_cache, batch, head_size**-0.5)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, ref_batch, head_size**-0.5)
    assert_close(out, expected)


@pytest.mark.parametrize("block_size", [8, 32])  # a kernel step spans two blocks / half a block
def test_paged_decode_split_k(ops: CudaOps, ref: CpuOps, torch_device: torch.device, block_size: int) -> None:
    contexts, num_blocks = [3, 150, 97], 80
    batch, ref_batch = decode_batches(ops, ref, contexts, block_size, num_blocks, torch_device)
    q = randn(3, 6, 32, device=torch_device)
    k_cache = randn(num_blocks, block_size, 2, 32, device=torch_device, seed=1)
    v_cache = randn(num_blocks, block_size, 2, 32, device=torch_device, seed=2)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, ref_batch, 0.2)
    # 5 partitions of 32 tokens: the 3-token sequence leaves 4 of its partitions empty
    plan = attention.SplitPlan(num_splits=5, tokens_per_split=32)
    out = attention.paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens, block_size, 0.2, plan,
                                 ops.config("gqa_decode"), ops.config("attn_reduce"))  # fmt: skip
    assert_close(out, expected)


def test_paged_decode_heuristic_splits_long_context(ops: CudaOps, ref: CpuOps, torch_device: torch.device) -> None:
    contexts, block_size, num_blocks = [700], 16, 48
    batch, ref_batch = decode_batches(ops, ref, contexts, block_size, num_blocks, torch_device)
    cfg = ops.config("gqa_decode")
    assert attention.plan_splits(1, 700, ops.num_sms, cfg).num_splits > 1 or torch_device.type == "cuda"
    q = randn(1, 2, 16, device=torch_device)
    k_cache = randn(num_blocks, block_size, 1, 16, device=torch_device, seed=1)
    v_cache = randn(num_blocks, block_size, 1, 16, device=torch_device, seed=2)
    out = ops.paged_decode_attention(q, k_cache, v_cache, batch, 0.25)
    assert_close(out, ref.paged_decode_attention(q, k_cache, v_cache, ref_batch, 0.25))


def test_plan_splits() -> None:
    cfg = LaunchConfig(block_n=32, split_tokens=256, max_splits=16)
    assert attention.plan_splits(200, 32768, 132, cfg) == attention.SplitPlan(1, 32768)  # the grid fills the GPU
    assert attention.plan_splits(4, 300, 132, cfg) == attention.SplitPlan(1, 320)  # too short to split
    assert attention.plan_splits(3, 32768, 132, cfg) == attention.SplitPlan(16, 2048)  # capped at max_splits
    assert attention.plan_splits(40, 32768, 132, cfg) == attention.SplitPlan(7, 4704)  # ~2 programs per SM
    assert attention.plan_splits(4, 1000, 8, LaunchConfig(max_splits=1)).num_splits == 1


def test_prepare_decode(ops: CudaOps, torch_device: torch.device) -> None:
    tables = torch.tensor([[3, 1], [2, 0]], device=torch_device)  # int64 in, int32 out
    batch = ops.prepare_decode(tables, torch.tensor([20, 7], device=torch_device), 16)
    assert batch.block_tables.dtype == batch.context_lens.dtype == torch.int32
    assert batch.extra.max_context_len == 20


# -- MLA decode ---------------------------------------------------------------------------------------------------

MLA_SHAPES = {
    "tiny": (16, 64, 16),
    "test_model": (4, 32, 8),  # the random DeepSeek-V3 of tests/conftest.py
    "tiny_odd": (5, 48, 8),  # fewer heads than a tile, R and P not powers of two
    "deepseek_v3_dims": (20, 512, 64),
}


@pytest.mark.parametrize("num_heads, rank, rope_dim", MLA_SHAPES.values(), ids=MLA_SHAPES.keys())
def test_mla_decode_attention(ops: CudaOps, ref: CpuOps, torch_device: torch.device, num_heads: int, rank: int,
                              rope_dim: int) -> None:  # fmt: skip
    contexts, block_size, num_blocks = [16, 3, 90], 16, 24
    batch, ref_batch = decode_batches(ops, ref, contexts, block_size, num_blocks, torch_device)
    q_latent = randn(3, num_heads, rank, device=torch_device, scale=0.3)
    q_rope = randn(3, num_heads, rope_dim, device=torch_device, seed=1)
    kv_cache = randn(num_blocks, block_size, rank + rope_dim, device=torch_device, seed=2)
    scale = (rank + rope_dim) ** -0.5
    out = ops.mla_decode_attention(q_latent, q_rope, kv_cache, batch, scale)
    assert_close(out, ref.mla_decode_attention(q_latent, q_rope, kv_cache, ref_batch, scale))


def test_mla_decode_split_k(ops: CudaOps, ref: CpuOps, torch_device: torch.device) -> None:
    contexts, block_size, num_blocks = [130, 20], 16, 24
    batch, ref_batch = decode_batches(ops, ref, contexts, block_size, num_blocks, torch_device)
    q_latent = randn(2, 8, 32, device=torch_device)
    q_rope = randn(2, 8, 16, device=torch_device, seed=1)
    kv_cache = randn(num_blocks, block_size, 48, device=torch_device, seed=2)
    expected = ref.mla_decode_attention(q_latent, q_rope, kv_cache, ref_batch, 0.15)
    plan = attention.SplitPlan(num_splits=3, tokens_per_split=48)
    out = attention.mla_decode(q_latent, q_rope, kv_cache, batch.block_tables, batch.context_lens, block_size, 0.15,
                               plan, ops.config("mla_decode"), ops.config("attn_reduce"))  # fmt: skip
    assert_close(out, expected)


# -- MoE ----------------------------------------------------------------------------------------------------------


def moe_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, num_used: int,
               device: torch.device) -> MoeInputs:  # fmt: skip
    """Routing only to the first `num_used` experts, so the others receive no tokens."""
    gen = torch.Generator().manual_seed(3)
    topk_ids = torch.stack([torch.randperm(num_used, generator=gen)[:top_k] for _ in range(num_tokens)])  # (T, k)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)  # (T, k)
    x = randn(num_tokens, hidden, device=device)
    w_gate_up = randn(num_experts, 2 * inter, hidden, device=device, seed=1, scale=hidden**-0.5)
    w_down = randn(num_experts, hidden, inter, device=device, seed=2, scale=inter**-0.5)
    return x, w_gate_up, w_down, topk_ids.int().to(device), topk_weights.to(device)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_moe_experts(ops: CudaOps, ref: CpuOps, torch_device: torch.device, num_tokens: int) -> None:
    inputs = moe_inputs(num_tokens, 16, 4, 64, 48, num_used=11, device=torch_device)
    assert_close(ops.moe_experts(*inputs), ref.moe_experts(*inputs))


def test_moe_large_tiles_in_chunks(ref: CpuOps, torch_device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = moe_inputs(37, 16, 4, 64, 48, num_used=9, device=torch_device)
    # a buffer of 16 tokens' pairs: three chunks of 16, 16 and 5 tokens
    monkeypatch.setattr(moe, "_PAIR_BUFFER_BYTES", 16 * 4 * 64 * 4)
    out = moe.moe_experts(*inputs, get_config("moe_large", None))
    assert_close(out, ref.moe_experts(*inputs))


def test_align_pairs() -> None:
    topk_ids = torch.tensor([[2, 0], [2, 3], [2, 0]])  # pairs 0..5; expert 1 receives none
    layout = moe.align_pairs(topk_ids, num_experts=4, block_m=2)
    pad = 6
    # expert 0: pairs 1, 5; expert 2: pairs 0, 2, 4 (+ pad); expert 3: pair 3 (+ pad); the rest is slack
    assert layout.sorted_pairs.tolist()[:8] == [1, 5, 0, 2, 4, pad, 3, pad]
    assert all(p == pad for p in layout.sorted_pairs.tolist()[8:])
    assert layout.block_experts.tolist()[:4] == [0, 2, 2, 3]
    assert all(e == -1 for e in layout.block_experts.tolist()[4:])


# -- configs and input checks -------------------------------------------------------------------------------------


def test_configs_per_capability() -> None:
    assert get_config("moe_large", HOPPER).num_stages > get_config("moe_large", None).num_stages
    assert get_config("moe_large", BLACKWELL).block_n >= get_config("moe_large", HOPPER).block_n
    assert get_config("gqa_decode", (8, 0)) == get_config("gqa_decode", None)
    with pytest.raises(KeyError):
        get_config("conv2d", HOPPER)
    with pytest.raises(ValueError):
        LaunchConfig(block_m=8)


def test_rejects_bad_inputs(ops: CudaOps, ref: CpuOps, torch_device: torch.device) -> None:
    with pytest.raises(ValueError, match="silu_and_mul"):
        ops.silu_and_mul(randn(2, 7, device=torch_device))
    batch, ref_batch = decode_batches(ops, ref, [4], 16, 4, torch_device)
    q, cache = randn(1, 4, 16, device=torch_device), randn(4, 16, 3, 16, device=torch_device)
    with pytest.raises(ValueError, match="K dividing H"):
        ops.paged_decode_attention(q, cache, cache, batch, 1.0)
    with pytest.raises(TypeError, match="prepare_decode"):
        ops.paged_decode_attention(q, cache[:, :, :2], cache[:, :, :2], ref_batch, 1.0)
