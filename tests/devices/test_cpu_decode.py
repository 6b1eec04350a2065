"""The cpu module's decode attention: segments of similar lengths, each read at its own length, checked against
attention over each sequence's own tokens alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from devices.cpu import CpuOps, plan_segments

BLOCK_SIZE = 4


def test_plan_segments_buckets_sorted_rows() -> None:
    # 2 rows of 10 blocks, 3 of 4, 1 of 1: one segment would attend 60 blocks; three attend 20 + 12 + 1
    assert plan_segments([10, 10, 4, 4, 4, 1], overhead_blocks=2) == [(0, 2, 10), (2, 5, 4), (5, 6, 1)]
    # segments dearer than the padding they save merge: three cost 33 blocks + 90, one 60 + 30, two 36 + 60
    assert plan_segments([10, 10, 4, 4, 4, 1], overhead_blocks=30) == [(0, 6, 10)]
    # two: 36 + 16 blocks; three: 33 + 24
    assert plan_segments([10, 10, 4, 4, 4, 1], overhead_blocks=8) == [(0, 2, 10), (2, 6, 4)]


def test_plan_segments_any_order_covers_every_row() -> None:
    segments = plan_segments([1, 9, 1, 9], overhead_blocks=0)
    assert segments == [(0, 1, 1), (1, 2, 9), (2, 3, 1), (3, 4, 9)]
    assert plan_segments([3], overhead_blocks=100) == [(0, 1, 3)]


def _tables(context_lens: list[int], num_blocks: int) -> tuple[torch.Tensor, list[list[int]]]:
    """(B, M) int32 block tables padded with 0, and each sequence's own blocks (shuffled, distinct, none is 0)."""
    gen = torch.Generator().manual_seed(0)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    own, width = [], max(-(-n // BLOCK_SIZE) for n in context_lens)
    for n in context_lens:
        own.append([ids.pop() for _ in range(-(-n // BLOCK_SIZE))])
    tables = torch.tensor([t + [0] * (width - len(t)) for t in own], dtype=torch.int32)
    return tables, own


def _own_tokens(cache: torch.Tensor, blocks: list[int], num_tokens: int) -> torch.Tensor:
    return cache[torch.tensor(blocks)].flatten(0, 1)[:num_tokens]  # (L, *F)


# Longest first as the model runner orders rows (lengths on and off block boundaries), and an unsorted batch.
LENGTHS = [[37, 36, 33, 12, 9, 8, 3, 1], [5, 40, 1, 16, 22]]


@pytest.mark.parametrize("context_lens", LENGTHS)
def test_paged_decode_attention_reads_each_sequence_alone(context_lens: list[int]) -> None:
    ops, gen = CpuOps(), torch.Generator().manual_seed(1)
    ops.segment_overhead_tokens = BLOCK_SIZE  # small sequences: a cheap segment, so several form
    num_heads, num_kv_heads, head_dim, num_blocks = 6, 2, 8, 64
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    tables, own = _tables(context_lens, num_blocks)
    batch = ops.prepare_decode(tables, torch.tensor(context_lens, dtype=torch.int32), BLOCK_SIZE)
    assert len(batch.extra.segments) > 1  # the point of the test: more than one segment
    out = ops.paged_decode_attention(q, k_cache, v_cache, batch, 0.3)
    for row, (n, blocks) in enumerate(zip(context_lens, own, strict=True)):
        k = _own_tokens(k_cache, blocks, n).transpose(0, 1)  # (K, L, D)
        v = _own_tokens(v_cache, blocks, n).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[row, :, None], k, v, scale=0.3, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-6)
    again = ops.paged_decode_attention(q, k_cache, v_cache, batch, 0.3)  # through the reused gather buffers
    assert torch.equal(again, out)


@pytest.mark.parametrize("context_lens", LENGTHS)
def test_mla_decode_attention_reads_each_sequence_alone(context_lens: list[int]) -> None:
    ops, gen = CpuOps(), torch.Generator().manual_seed(2)
    ops.segment_overhead_tokens = BLOCK_SIZE
    num_heads, rank, rope_dims, num_blocks = 4, 16, 4, 64
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope_dims, generator=gen)
    q_latent = torch.randn(len(context_lens), num_heads, rank, generator=gen)
    q_rope = torch.randn(len(context_lens), num_heads, rope_dims, generator=gen)
    tables, own = _tables(context_lens, num_blocks)
    batch = ops.prepare_decode(tables, torch.tensor(context_lens, dtype=torch.int32), BLOCK_SIZE)
    assert len(batch.extra.segments) > 1
    out = ops.mla_decode_attention(q_latent, q_rope, kv_cache, batch, 0.25)
    for row, (n, blocks) in enumerate(zip(context_lens, own, strict=True)):
        entries = _own_tokens(kv_cache, blocks, n)  # (L, R+P)
        scores = torch.cat([q_latent[row], q_rope[row]], dim=-1) @ entries.T * 0.25  # (H, L)
        expected = scores.softmax(dim=-1) @ entries[:, :rank]  # (H, R)
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-6)
