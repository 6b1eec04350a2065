"""The rotation as applied (x * cos + (x2, x1) * sin over full-width tables built once a step) gives the written-out
rotation bit for bit: halves (Llama) and adjacent pairs (DeepSeek-V3), float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from engine_core.models.rope import RotaryEmbedding


def _written_out(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The reference form: (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin (T, 1, d/2) cast to x's dtype first."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_the_written_out_form(interleaved: bool, dtype: torch.dtype) -> None:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64} if interleaved else None
    rope = RotaryEmbedding(16, 10000.0, scaling, 256, interleaved=interleaved)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    x = torch.randn(len(positions), 5, 16, generator=gen).to(dtype)
    half_cos, half_sin = rope.cos_sin(positions)
    out = rope(x, *rope.rotation(positions))
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, _written_out(x, half_cos, half_sin, interleaved))
    assert not torch.equal(out, x)  # it rotated something


def test_rotation_of_a_strided_view() -> None:
    """Llama rotates q and k as a view of the fused qkv output: a view's rotation equals its copy's."""
    rope = RotaryEmbedding(8, 10000.0, None, 64, interleaved=False)
    qkv = torch.randn(3, 6 * 8, generator=torch.Generator().manual_seed(1))
    view = qkv[:, : 4 * 8].view(3, 4, 8)
    tables = rope.rotation(torch.tensor([2, 9, 30]))
    assert torch.equal(rope(view, *tables), rope(view.contiguous(), *tables))
