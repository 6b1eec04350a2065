"""The cpu module's prefill attention: a chunk's queries over cached context by grouped GEMMs, and SDPA for the
rest, both checked against attention written out head by head in float64."""

from __future__ import annotations

import pytest
import torch

from devices.cpu import (
    CHUNK_GEMM_MAX_QUERIES,
    CHUNK_GEMM_MIN_CONTEXT,
    CpuOps,
    chunk_attention,
    sdpa_prefill_attention,
)

SCALE = 0.3


def _inputs(
    num_new: int, num_cached: int, num_heads: int, num_kv_heads: int, head_dim: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_new * 1000 + num_cached)
    num_total = num_cached + num_new
    q = torch.randn(num_new, num_heads, head_dim, generator=gen)
    k = torch.randn(num_total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_total, num_kv_heads, v_dim, generator=gen)
    return q, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """Query i (position num_cached + i) of head h over keys 0 .. num_cached + i of KV head h // group."""
    num_new, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(num_new, num_heads, v.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        for i in range(num_new):
            keys, values = k[: num_cached + i + 1, h // group].double(), v[: num_cached + i + 1, h // group].double()
            probs = (keys @ q[i, h].double() * SCALE).softmax(dim=0)  # (num_cached + i + 1,)
            out[i, h] = probs @ values
    return out.float()


# (new queries, cached tokens, query heads, KV heads, head size, value size): one query and a block-sized chunk
# over short and long contexts, SmolLM2-135M's heads (9 over 3) late in an 8k prompt, a longer chunk, heads not
# grouped (MLA's expanded form, values narrower than keys), and a prompt from position 0.
CASES = [
    (1, 1, 6, 2, 8, 8),
    (1, 37, 6, 2, 8, 8),
    (16, 16, 6, 2, 8, 8),
    (8, 7783, 9, 3, 64, 64),
    (64, 100, 4, 1, 16, 16),
    (5, 21, 4, 4, 12, 8),
    (7, 0, 6, 2, 8, 8),
]


@pytest.mark.parametrize(("num_new", "num_cached", "num_heads", "num_kv_heads", "head_dim", "v_dim"), CASES)
def test_chunk_attention_matches_attention_head_by_head(
    num_new: int, num_cached: int, num_heads: int, num_kv_heads: int, head_dim: int, v_dim: int
) -> None:
    q, k, v = _inputs(num_new, num_cached, num_heads, num_kv_heads, head_dim, v_dim)
    expected = _reference(q, k, v, num_cached)
    out = chunk_attention(q, k, v, num_cached, SCALE)
    assert out.shape == (num_new, num_heads, v_dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(out, sdpa_prefill_attention(q, k, v, num_cached, SCALE), rtol=1e-5, atol=2e-6)


MIN_CACHED = CHUNK_GEMM_MIN_CONTEXT - CHUNK_GEMM_MAX_QUERIES  # a largest chunk after it fills the shortest context


@pytest.mark.parametrize(
    ("num_new", "num_cached", "num_kv_heads", "uses_gemm"),
    [
        (8, 7783, 2, True),
        (CHUNK_GEMM_MAX_QUERIES, MIN_CACHED, 2, True),
        (CHUNK_GEMM_MAX_QUERIES + 1, MIN_CACHED, 2, False),  # too many queries
        (CHUNK_GEMM_MAX_QUERIES, MIN_CACHED - 1, 2, False),  # too short a context
        (8, 7783, 6, False),  # heads not grouped
    ],
)
def test_prefill_attention_takes_gemm_for_short_chunks_over_long_contexts(
    num_new: int, num_cached: int, num_kv_heads: int, uses_gemm: bool
) -> None:
    q, k, v = _inputs(num_new, num_cached, 6, num_kv_heads, 8, 8)
    out = CpuOps().prefill_attention(q, k, v, num_cached, SCALE)
    chosen = chunk_attention if uses_gemm else sdpa_prefill_attention
    assert torch.equal(out, chosen(q, k, v, num_cached, SCALE))
    torch.testing.assert_close(out, _reference(q, k, v, num_cached), rtol=1e-5, atol=2e-6)
