"""DeepSeek-V4's small pieces: norms kept in fp32, the interleaved rotation of a vector's tail."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, multiply by the (fp32) weight, cast back once: x (..., n), weight (n,)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., n) over its last dimension, no weight (per-head query norm, the hyper-connections' input)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last r dims of x (T, h, d) by adjacent pairs (x0, x1), (x2, x3)... in place of them (the layout
    stays interleaved: V4 reads a token's one KV vector as its value too). cos, sin: (T, 1, r/2)."""
    half = cos.shape[-1]
    cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()  # the reference rounds them to x's dtype first
    nope, rope = x[..., : -2 * half], x[..., -2 * half :].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


class Fp32RMSNorm(nn.Module):
    """A weighted RMSNorm whose weight stays fp32 whatever the model's dtype (as DeepSeek-V4 keeps it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
