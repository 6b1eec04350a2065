"""The tokens a sampled row can draw, with their probabilities, found without sorting the vocabulary.

The sampler (`sampler.py`) draws from a `Candidates`: per row, some token ids and their probabilities under the
tempered distribution, zero-padded to the group's widest row. Three ways to build one, by the row's settings:

- top-k: the k largest logits (`topk`, a partial selection, already in descending order); probabilities
  relative to those k, as top-k renormalizes before top-p.
- top-p and/or min-p without top-k: the NUCLEUS_WIDTH most likely tokens, when the kept set provably ends inside
  them (nearly every row of real text); for a flatter row, every token that can survive (`_survivors`), sorted.
  The exact top-p and min-p then run on the candidates. Probabilities stay relative to the whole vocabulary, as
  top-p's mass is.
- neither: the whole distribution, in vocabulary order (the inverse-CDF draw needs no order).

Every operation is row-wise and padding only appends zeros, so a row's candidates do not depend on its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Top-p/min-p candidates first tried per row: the most likely tokens that one partial selection finds cheaply
# (`topk` slows sharply above a few hundred); nearly every row of real text keeps fewer.
NUCLEUS_WIDTH = 256

# The survivors' cut is loosened by this many nats so that rounding never drops a token the exact top-p (run
# on the candidates in float32) would keep; a few extra candidates cost nothing.
_CUT_MARGIN = 1e-3


@dataclass(frozen=True)
class Candidates:
    probs: torch.Tensor  # (b, K) float32: each candidate's probability; 0 at padding
    token_ids: torch.Tensor | None  # (b, K) int64 vocabulary ids; None when the candidates are the whole vocabulary
    is_sorted: bool  # probabilities in descending order along each row (top-p needs it)


def top_k_candidates(logits: torch.Tensor, temperature: torch.Tensor, top_k: int) -> Candidates:
    """logits (b, V) float32, temperature (b,), 0 < top_k < V."""
    values, token_ids = logits.topk(top_k, dim=-1)  # (b, k), descending; temperature > 0 keeps the order
    return Candidates((values / temperature[:, None]).softmax(dim=-1), token_ids, is_sorted=True)


def full_distribution(logits: torch.Tensor, temperature: torch.Tensor) -> Candidates:
    return Candidates((logits / temperature[:, None]).softmax(dim=-1), None, is_sorted=False)  # (b, V)


def nucleus_candidates(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> Candidates:
    """logits (b, V) float32; temperature, top_p, min_p (b,). The tokens that top-p and min-p may keep, sorted.

    First the NUCLEUS_WIDTH most likely tokens of every row (a partial selection); a row whose kept set provably
    ends inside them is done. The others (a flat distribution) keep every token that can survive, sorted."""
    scaled = logits / temperature[:, None]  # (b, V)
    log_norm = scaled.logsumexp(dim=-1)  # (b,)
    values, token_ids = scaled.topk(min(NUCLEUS_WIDTH, scaled.shape[-1]), dim=-1)  # (b, W) descending
    probs = (values - log_norm[:, None]).exp()  # (b, W) relative to the whole vocabulary, as top-p's mass is
    # top-p ends inside once the candidates' mass reaches top_p; min-p once the last one falls below its cut
    covered = (probs.cumsum(dim=-1)[:, -1] >= top_p) | (probs[:, -1] < probs[:, 0] * min_p)
    if values.shape[-1] == scaled.shape[-1] or bool(covered.all()):  # the whole vocabulary, or every row done
        return Candidates(probs, token_ids, is_sorted=True)
    rows = [int(i) for i in (~covered).nonzero()[:, 0]]
    survivors = [_survivors(scaled[i], log_norm[i], float(top_p[i]), float(min_p[i])) for i in rows]
    width = max(probs.shape[-1], *(ids.numel() for _, ids in survivors))
    probs, token_ids = _pad(probs, width, 0.0), _pad(token_ids, width, 0)
    for i, (row_probs, row_ids) in zip(rows, survivors, strict=True):
        probs[i], token_ids[i] = _pad(row_probs[None], width, 0.0)[0], _pad(row_ids[None], width, 0)[0]
    return Candidates(probs, token_ids, is_sorted=True)


def _survivors(scaled: torch.Tensor, log_norm: torch.Tensor, top_p: float, min_p: float) -> tuple[torch.Tensor, ...]:
    """One row's tokens that top-p and min-p may keep, most likely first: (probs, token ids), each (n,).

    A token whose probability is at most (1 - top_p) / V never enters the nucleus: the tokens from it on (in
    descending order) would hold more than 1 - top_p, so the ones before it already reach top_p. Min-p's cut
    (p >= min_p x the best p) is exact. Both are compared in logit space, loosened by _CUT_MARGIN."""
    cut = max(
        float(log_norm) + math.log((1.0 - top_p) / scaled.shape[-1]) if top_p < 1.0 else -math.inf,
        float(scaled.max()) + math.log(min_p) if min_p > 0.0 else -math.inf,
    )
    token_ids = (scaled >= cut - _CUT_MARGIN).nonzero()[:, 0]  # (n,) in vocabulary order
    values, order = scaled[token_ids].sort(descending=True, stable=True)  # ties stay in vocabulary order
    return (values - log_norm).exp(), token_ids[order]


def _pad(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """(b, n) -> (b, width), `fill` appended."""
    return torch.nn.functional.pad(values, (0, width - values.shape[-1]), value=fill)
