"""The inverse-CDF pick: per row, the first token whose cumulative weight exceeds the row's uniform x its total.

The definition (`exact_pick`) is the float64 running sum of the row's weights in order: a seeded stream's tokens are
fixed by it, rounding included. Over a whole vocabulary that running sum is one long chain of dependent additions
(32 x 49,152 took about 1 ms, a third of a temperature-only row's sampling), so `pick` finds the same token in
two levels: the weights' sums per chunk of PICK_CHUNK tokens (vectorized), the chunk where the target falls, then
the running sum inside that chunk only.

Why it is the same token: both ways round differently from the exact sum, by at most `_error_bound` x total
(the classic bound for summing non-negative terms, taken loosely). A pick whose target lies further than that
from both edges of the picked token's interval is the definition's pick too; a row where it does not (a draw in
about 15,000 with chunks summed in float32; a row with no weight or a NaN) takes `exact_pick`. So the token
never differs, only the work.
"""

from __future__ import annotations

import torch

PICK_CHUNK = 128  # tokens per chunk of the two-level pick
_TWO_LEVEL_MIN_WIDTH = 4 * PICK_CHUNK  # narrower rows (top-k, top-p candidates) take the running sum directly
_ROUNDOFF64 = 2.0**-53
_ROUNDOFF32 = 2.0**-24


def pick(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row of probs (b, K) (any non-negative weights), the first index whose cumulative weight
    exceeds uniform x total; uniforms (b,) float64 in [0, 1). A zero-weight index is never picked."""
    width = probs.shape[-1]
    if width < _TWO_LEVEL_MIN_WIDTH:
        return exact_pick(probs, uniforms)
    ends = _chunk_sums(probs).cumsum(dim=-1)  # (b, n) running weight at each chunk's end
    total = ends[:, -1:]  # (b, 1)
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # (b, 1)
    chunk = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[-1] - 1)  # (b, 1)
    start = torch.where(chunk > 0, ends.gather(-1, (chunk - 1).clamp(min=0)), 0.0)  # (b, 1) weight before it
    positions = chunk * PICK_CHUNK + torch.arange(PICK_CHUNK, device=probs.device)  # (b, C)
    weights = probs.gather(-1, positions.clamp(max=width - 1)).to(torch.float64)  # (b, C)
    cdf = start + weights.masked_fill_(positions >= width, 0.0).cumsum(dim=-1)  # (b, C) the tail chunk padded
    local = torch.searchsorted(cdf, target, right=True).clamp_(max=PICK_CHUNK - 1)  # (b, 1)
    above = cdf.gather(-1, local)  # (b, 1) cumulative weight through the picked token
    below = torch.where(local > 0, cdf.gather(-1, (local - 1).clamp(min=0)), start)  # (b, 1) ... before it
    margin = _error_bound(width) * total  # (b, 1)
    picked = chunk * PICK_CHUNK + local  # (b, 1)
    unsure = ~((above - target > margin) & (target - below > margin))[:, 0]  # (b,) NaN and zero rows too
    if bool(unsure.any()):
        rows = unsure.nonzero()[:, 0]
        picked[rows, 0] = exact_pick(probs[rows], uniforms[rows])
    return picked[:, 0]


def exact_pick(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The definition `pick` keeps: the float64 running sum over the whole row and a binary search in it."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (b, K); float64: no rounding drift over 49k terms
    total = cdf[:, -1:]  # (b, 1)
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # strictly below the total, the first index whose cdf exceeds the target is one where the cdf rose
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)  # (b, 1)
    if not bool((total > 0).all()):  # a row with nothing left (all masked) takes its best token
        picked = torch.where(total > 0, picked, probs.argmax(dim=-1, keepdim=True))
    return picked[:, 0]


def _chunk_sums(probs: torch.Tensor) -> torch.Tensor:
    """(b, K) -> (b, ceil(K / PICK_CHUNK)) float64: each chunk's weight, the last chunk possibly shorter. Summed in
    the weights' own float32 (a float64 sum would first copy the whole tensor to float64): `_error_bound` allows
    for it."""
    num_rows, width = probs.shape
    num_full = width // PICK_CHUNK
    sums = probs[:, : num_full * PICK_CHUNK].reshape(num_rows, num_full, PICK_CHUNK).sum(dim=-1)  # (b, num_full)
    if num_full * PICK_CHUNK < width:
        sums = torch.cat([sums, probs[:, num_full * PICK_CHUNK :].sum(dim=-1, keepdim=True)], dim=-1)
    return sums.to(torch.float64)


def _error_bound(width: int) -> float:
    """How far, relative to the total, the two-level cumulative sums and target may be from the running sum's.
    n non-negative terms summed in any order are off by at most (n - 1) units of roundoff x their sum: the running
    sum by (width - 1) float64 units; the two levels by (PICK_CHUNK - 1) float32 units (a chunk's sum) plus float64
    units for the chunks' running sum, the one inside a chunk and the addition of both; the targets (uniform x
    total) by that difference again plus two roundings. The margin doubles it all, for slack."""
    num_chunks = -(-width // PICK_CHUNK)
    sums = (PICK_CHUNK - 1) * _ROUNDOFF32 + (width + num_chunks + PICK_CHUNK + 2) * _ROUNDOFF64
    return 2.0 * (2.0 * sums + 4.0 * _ROUNDOFF64)
