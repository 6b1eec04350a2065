"""Rotary position embeddings: the plain form, Llama-3 and linear scaling, and YaRN (DeepSeek-V3).

cos/sin are computed exactly as the reference implementations compute them (fp32 positions times
inverse frequencies, then cos/sin scaled by the attention factor), so logits match to fp32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    factor = float(scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # share of each frequency kept as trained
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low_wavelen = original / scaling.get("low_freq_factor", 1.0)
    high_wavelen = original / scaling.get("high_freq_factor", 4.0)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - scaling.get("low_freq_factor", 1.0)) / (
        scaling.get("high_freq_factor", 4.0) - scaling.get("low_freq_factor", 1.0)
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(
    dim: int, base: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq (dim/2,), attention factor) for a rotary dimension `dim`."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, scaling, max_positions)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}: supported are linear, llama3, yarn")


class RotaryEmbedding:
    """Applies rotary embeddings to (T, h, d) tensors at given positions.

    interleaved=False rotates the halves (x[:d/2], x[d/2:]) (Llama); interleaved=True rotates adjacent
    pairs (x0, x1), (x2, x3) and returns the rotated pairs de-interleaved into halves, as the reference
    DeepSeek-V3 implementation does (q and k get the same layout, so their dot products are unchanged).
    """

    def __init__(self, dim: int, base: float, scaling: dict[str, Any] | None, max_positions: int, interleaved: bool):
        with torch.device("cpu"):  # models are built on the meta device; these frequencies are real values
            self.inv_freq, self.attention_factor = inverse_frequencies(dim, base, scaling, max_positions)
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, d/2), once per step and shared by every layer."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, d/2)
        return (freqs.cos() * self.attention_factor)[:, None, :], (freqs.sin() * self.attention_factor)[:, None, :]

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> the tables __call__ takes, once per step: cos (T, 1, d) repeated over both halves and
        sin (T, 1, d) negated on the first, so that a rotation is x * cos + (x2, x1) * sin in three ops."""
        cos, sin = self.cos_sin(positions)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, h, d) -> x rotated, in halves; cos, sin (T, 1, d) from rotation().

        The halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin): the same products and sums as written out,
        since adding a negated product is the same IEEE operation as subtracting it."""
        if self.interleaved:  # pairs (x0, x1), (x2, x3)... -> halves (x0, x2, ..., x1, x3, ...)
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1), a new tensor
        return (x * cos).add_(swapped.mul_(sin))
