"""The tokens a sampled row can draw, with their probabilities, found without sorting the vocabulary.

The sampler (`sampler.py`) draws from a `Candidates`: per row, some token ids and their probabilities under the
tempered distribution, zero-padded to the group's widest row. Three ways to build one, by the row's settings:

- top-k: the k largest logits (`topk`, a partial selection, already in descending order); probabilities
  relative to those k, as top-k renormalizes before top-p.
- top-p and/or min-p without top-k: the NUCLEUS_WIDTH most likely tokens, when the kept set provably ends inside
  them (most rows of real text); the flatter rows, together, take the tokens down to where a histogram of the
  row's mass over its log-probabilities shows the kept set ends (one scatter-add), sorted. The exact top-p and
  min-p then run on the candidates. Probabilities stay relative to the whole vocabulary, as top-p's mass is.
- neither: the whole distribution, in vocabulary order (the inverse-CDF draw needs no order).

Every operation is row-wise and padding only appends zeros, so a row's candidates do not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Top-p/min-p candidates first tried per row: the most likely tokens that one partial selection finds cheaply
# (`topk` slows sharply above a few hundred); most rows of real text keep fewer.
NUCLEUS_WIDTH = 256

# A row whose kept set is wider: its probability mass in buckets of BUCKET_NATS nats of log-probability below
# its best token (the last bucket also holds everything lower). Its candidates are its tokens down to the bucket
# where the kept set provably ends, so their number exceeds the kept set's by about two buckets' worth.
BUCKET_NATS = 1.0 / 16.0
NUM_BUCKETS = 256

# The top-p bound uses the buckets' mass loosened by this share, so that rounding (the buckets sum in another
# order than the exact top-p on the candidates) never leaves out a token the exact top-p keeps.
_MASS_MARGIN = 1e-3

_MIN_P_FLOOR = 1e-30  # min_p 0 (no min-p) maps to a cut below every bucket


@dataclass(frozen=True)
class Candidates:
    probs: torch.Tensor  # (b, K) float32: each candidate's probability; 0 at padding
    token_ids: torch.Tensor | None  # (b, K) int64 vocabulary ids; None when the candidates are the whole vocabulary
    is_sorted: bool  # probabilities in descending order along each row (top-p needs it)


def top_k_candidates(logits: torch.Tensor, temperature: torch.Tensor, top_k: int) -> Candidates:
    """logits (b, V) float32, temperature (b,), 0 < top_k < V."""
    values, token_ids = logits.topk(top_k, dim=-1)  # (b, k), descending; temperature > 0 keeps the order
    return Candidates((values / temperature[:, None]).softmax(dim=-1), token_ids, is_sorted=True)


def full_distribution(probs: torch.Tensor) -> Candidates:
    return Candidates(probs, None, is_sorted=False)  # (b, V)


class Workspace:
    """Vocabulary-wide tensors that one Sampler reuses call after call (only its calls write them, one at
    a time). A fresh tensor of that size costs a page fault per 4 KiB on first touch: about 3,000 per call for a
    temperature-only batch of 32 x 49,152, which took longer than the arithmetic on those tensors."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}  # grown to the largest batch seen, never shrunk

    def take(
        self, name: str, shape: tuple[int, int], like: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """An uninitialized tensor of `shape` on like's device: the memory `name` had last time."""
        numel = shape[0] * shape[1]
        held = self._tensors.get(name)
        if held is None or held.numel() < numel or held.device != like.device or held.dtype != dtype:
            held = torch.empty(numel, dtype=dtype, device=like.device)
            self._tensors[name] = held
        return held[:numel].view(shape)


def tempered(
    logits: torch.Tensor, temperature: torch.Tensor, workspace: Workspace, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaled, probs), each (b, V): logits (b, V) float32 / temperature (b,) bit for bit (logits themselves at
    temperature 1; in place when the caller lets logits be overwritten) and its softmax, in workspace's tensors."""
    shape = (logits.shape[0], logits.shape[1])
    if bool((temperature == 1.0).all()):
        scaled = logits
    elif in_place:
        scaled = logits.div_(temperature[:, None])
    else:
        scaled = torch.div(logits, temperature[:, None], out=workspace.take("scaled", shape, logits))
    return scaled, torch.softmax(scaled, dim=-1, out=workspace.take("probs", shape, logits))


def nucleus_candidates(
    scaled: torch.Tensor,
    probs: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    workspace: Workspace,
) -> Candidates:
    """scaled (b, V) tempered logits and probs their softmax; top_p, min_p (b,). The tokens that top-p and min-p
    may keep, sorted.

    First the NUCLEUS_WIDTH most likely tokens of every row (one partial selection); a row whose kept set provably
    ends inside them is done. The others (flatter rows) take the histogram's bound (`_histogram_candidates`)."""
    values, token_ids = probs.topk(min(NUCLEUS_WIDTH, probs.shape[-1]), dim=-1)  # (b, W) descending
    # top-p ends inside once the candidates' mass reaches top_p (the cumulative sum the exact top-p takes);
    # min-p once the last candidate falls below its cut
    covered = (values.cumsum(dim=-1)[:, -1] >= top_p) | (values[:, -1] < values[:, 0] * min_p)  # (b,)
    if values.shape[-1] == probs.shape[-1] or bool(covered.all()):  # the whole vocabulary, or every row done
        return Candidates(values, token_ids, is_sorted=True)
    rows = (~covered).nonzero()[:, 0]  # (r,)
    wide_probs, wide_ids = _histogram_candidates(scaled, probs, rows, top_p[rows], min_p[rows], workspace)
    width = max(values.shape[-1], wide_probs.shape[-1])
    values, token_ids = _pad(values, width, 0.0), _pad(token_ids, width, 0)
    values[rows], token_ids[rows] = _pad(wide_probs, width, 0.0), _pad(wide_ids, width, 0)
    return Candidates(values, token_ids, is_sorted=True)


def _histogram_candidates(
    scaled: torch.Tensor,
    probs: torch.Tensor,
    rows: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled, probs (b, V); rows (r,) the rows to bound; top_p, min_p (r,). Each row's tokens down to the bucket
    where its kept set provably ends, most likely first, as (probs, token ids), each (r, K): one scatter-add and one
    sort of those tokens, however flat the row. The rows' copies live in the workspace."""
    shape = (rows.shape[0], scaled.shape[-1])
    below = torch.index_select(scaled, 0, rows, out=workspace.take("below", shape, scaled))  # (r, V)
    below.sub_(below.amax(dim=-1, keepdim=True))  # <= 0: log-probability relative to the best
    buckets = workspace.take("buckets", shape, scaled, torch.long)  # (r, V) non-decreasing in rank
    buckets.copy_(below.mul_(-1.0 / BUCKET_NATS).clamp_(max=NUM_BUCKETS - 1))  # truncated, as .long() does
    wide_probs = torch.index_select(probs, 0, rows, out=workspace.take("wide_probs", shape, probs))  # (r, V)
    last = _last_buckets(buckets, wide_probs, top_p, min_p)  # (r,)
    return _sorted(wide_probs, buckets <= last[:, None])


def _last_buckets(buckets: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """(b,): per row, the last bucket that may hold a token top-p and min-p keep.

    Top-p: the buckets up to the first one whose cumulative weight reaches top_p (loosened by _MASS_MARGIN) hold
    a prefix, in descending order, whose mass reaches top_p, so the smallest such prefix lies inside them.
    Min-p: a kept token is at most -log(min_p) nats below the best. Each bound takes one more bucket, as the
    exact filters (run on the candidates in float32) round differently."""
    num_rows = buckets.shape[0]
    last = torch.full((num_rows,), NUM_BUCKETS - 1, dtype=torch.long, device=buckets.device)
    if bool((top_p < 1.0).any()):
        mass = probs.new_zeros(num_rows, NUM_BUCKETS).scatter_add_(1, buckets, probs)  # (b, NB)
        reached = (mass.cumsum(dim=-1) < top_p[:, None] * (1.0 + _MASS_MARGIN)).sum(dim=-1) + 1  # (b,) + margin
        last = torch.where(top_p < 1.0, reached, last)
    if bool((min_p > 0.0).any()):
        nats = -min_p.clamp(min=_MIN_P_FLOOR).log()  # (b,); min_p 0 keeps every bucket
        last = torch.minimum(last, (nats / BUCKET_NATS).clamp(max=NUM_BUCKETS).long() + 1)
    return last.clamp_(max=NUM_BUCKETS - 1)


def _sorted(probs: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens of each row (keep (r, V) bool), most likely first, padded with zero probability."""
    rows, token_ids = keep.nonzero(as_tuple=True)  # (N,) each; row-major, so vocabulary order within a row
    counts = torch.bincount(rows, minlength=keep.shape[0])  # (r,)
    slots = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[rows]  # (N,)
    values = probs.new_zeros((keep.shape[0], int(counts.max())))  # (r, K)
    values[rows, slots] = probs[rows, token_ids]
    ids = token_ids.new_zeros(values.shape)  # (r, K)
    ids[rows, slots] = token_ids
    values, order = values.sort(dim=-1, descending=True, stable=True)  # ties stay in vocabulary order
    return values, ids.gather(-1, order)


def _pad(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """(b, n) -> (b, width), `fill` appended."""
    return torch.nn.functional.pad(values, (0, width - values.shape[-1]), value=fill)
