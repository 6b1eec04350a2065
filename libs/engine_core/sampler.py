"""Turns a batch of logits into next tokens, request by request.

Order of operations (as vLLM and transformers apply them): token masks, penalties, min_tokens, then
greedy argmax or temperature -> top-k -> top-p -> min-p -> a draw. Logprobs come from the model's raw
distribution, before any of these.

Cost: sampling must stay a small share of a model step for any settings (`kvmesh bench sampler`), so nothing
here sorts the vocabulary or draws noise over it:
- a draw is one uniform number per row and an inverse-CDF pick (a binary search in the running sum), which over
  the whole vocabulary sums chunks first and runs the sum inside one chunk only (`sampling_pick.py`: the same
  token as the full running sum, always);
- top-k takes the k largest logits (`topk`, a partial selection) and the rest works on those k candidates;
- top-p and min-p without top-k gather only the tokens down to where a histogram of the row's mass shows the
  kept set ends (`sampling_candidates.py`) and sort those few;
- penalties touch only the tokens that occurred, for all rows in one gather and scatter.
Rows that need the same work (greedy; the whole distribution; top-k of one k; top-p/min-p candidates) run as one
batched op per group. Vocabulary-wide intermediates (the sampler's copy of the logits, a group's rows, tempered
logits, probabilities) go into tensors the sampler keeps from call to call (`Workspace`): fresh ones of that size
cost more in page faults than the arithmetic done on them.

Seeds: a seeded request's uniform is a hash of (seed, output position), so its tokens depend only on its own
logits and parameters: the same seed gives the same tokens whatever else is in the batch, and the stream continues
identically after a preemption or after its KV moved to another engine. That holds because every computation on
a row is row-wise (the same result whatever rows share the tensor and whatever padding follows the row) and a
row's group depends only on its own parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_core.request import Request, TokenLogprobs
from engine_core.sampling_candidates import (
    Candidates,
    Workspace,
    full_distribution,
    nucleus_candidates,
    tempered,
    top_k_candidates,
)
from engine_core.sampling_params import SamplingParams
from engine_core.sampling_pick import pick

_MASK64 = 2**64 - 1


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # uniforms of unseeded requests; only this sampler draws from it, in batch order
        self._generator = torch.Generator().manual_seed(seed)
        self._workspace = Workspace()  # vocabulary-wide tensors reused by every call

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits (B, V), one row per request (any float dtype, any device); the caller's tensor is not written."""
        raw_logprobs = _raw_logprobs(logits, requests)
        if _writes_logits(requests):  # masks and penalties write in place, on the sampler's own copy
            own = self._workspace.take("logits", (logits.shape[0], logits.shape[1]), logits).copy_(logits)
        else:
            own = logits.to(torch.float32)
        is_owned = own is not logits  # a copy: temperature may scale it in place too
        own = _apply_masks(own, requests)
        own = _apply_penalties(own, requests)
        own = _apply_min_tokens(own, requests)
        token_ids = self._choose(own, requests, is_owned)
        logprobs = [
            _token_logprobs(raw_logprobs[i], token_ids[i], r.sampling_params.logprobs)
            if i in raw_logprobs and r.sampling_params.logprobs is not None
            else None
            for i, r in enumerate(requests)
        ]
        return SamplerOutput(token_ids, logprobs)

    def _choose(self, logits: torch.Tensor, requests: Sequence[Request], is_owned: bool) -> list[int]:
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if not random_rows:
            return logits.argmax(dim=-1).tolist()
        token_ids = [0] * len(requests)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        if greedy_rows:
            chosen = logits[_index(greedy_rows, logits)].argmax(dim=-1).tolist()
            for row, token in zip(greedy_rows, chosen, strict=True):
                token_ids[row] = token
        uniforms = dict(zip(random_rows, self._uniforms([requests[i] for i in random_rows]), strict=True))
        for rows in _groups(random_rows, requests, logits.shape[-1]).values():
            params = [requests[i].sampling_params for i in rows]
            if rows == list(range(logits.shape[0])):  # every row: no copy
                candidates = _candidates(logits, params, self._workspace, is_owned)
            else:
                group = self._workspace.take("rows", (len(rows), logits.shape[-1]), logits)
                torch.index_select(logits, 0, _index(rows, logits), out=group)
                candidates = _candidates(group, params, self._workspace, in_place=True)
            chosen = _draw(candidates, params, [uniforms[i] for i in rows]).tolist()
            for row, token in zip(rows, chosen, strict=True):
                token_ids[row] = token
        return token_ids

    def _uniforms(self, requests: Sequence[Request]) -> list[float]:
        """One uniform in [0, 1) per request: from its (seed, output position) when seeded, else fresh."""
        num_unseeded = sum(r.sampling_params.seed is None for r in requests)
        fresh = iter(torch.rand(num_unseeded, generator=self._generator, dtype=torch.float64).tolist())
        return [
            next(fresh)
            if r.sampling_params.seed is None
            else seeded_uniform(r.sampling_params.seed, r.num_output_tokens)
            for r in requests
        ]


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) (53 random bits) that only (seed, position) decide: splitmix64 twice."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 11) * 2.0**-53


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _groups(rows: list[int], requests: Sequence[Request], vocab_size: int) -> dict[tuple[str, int], list[int]]:
    """Rows that need the same work, keyed by it: a row's key depends only on its own parameters."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i in rows:
        params = requests[i].sampling_params
        if 0 < params.top_k < vocab_size:
            key = ("top_k", params.top_k)
        elif params.top_p < 1.0 or params.min_p > 0.0:
            key = ("nucleus", 0)
        else:
            key = ("full", 0)
        groups.setdefault(key, []).append(i)
    return groups


def _candidates(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    workspace: Workspace,
    in_place: bool = False,
) -> Candidates:
    """The tokens a group's rows can draw, with their probabilities (see sampling_candidates); in_place: logits
    may be overwritten (the sampler's own copy)."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    top_k = params[0].top_k  # a group shares its top-k (or has none within the vocabulary)
    if 0 < top_k < logits.shape[-1]:
        return top_k_candidates(logits, temperature, top_k)
    if any(p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        return nucleus_candidates(*tempered(logits, temperature, workspace, in_place), top_p, min_p, workspace)
    return full_distribution(tempered(logits, temperature, workspace, in_place)[1])


def _draw(candidates: Candidates, params: Sequence[SamplingParams], uniforms: Sequence[float]) -> torch.Tensor:
    """One token id per row (b,): top-p and min-p on the candidates, then an inverse-CDF pick."""
    probs = filtered_probs(candidates, params)
    target = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)
    picked = pick(probs, target)  # (b,)
    return picked if candidates.token_ids is None else candidates.token_ids.gather(-1, picked[:, None])[:, 0]


def filtered_probs(candidates: Candidates, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The candidates' probabilities (b, K) with top-p and min-p applied (not renormalized: the pick scales)."""
    probs = candidates.probs
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)
    if bool((top_p < 1.0).any()):
        assert candidates.is_sorted, "top-p needs candidates in descending order"
        before = probs.cumsum(dim=-1) - probs  # (b, K) mass of the more likely candidates
        # keep the smallest prefix whose mass reaches top_p (the crossing token is kept); rows without top-p
        # keep everything, whatever rounding did to their sums
        drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)
    if bool((min_p > 0.0).any()):  # relative to the best token: a row with min_p 0 drops nothing
        probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p[:, None], 0.0)
    return probs


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)


def _writes_logits(requests: Sequence[Request]) -> bool:
    return any(
        r.sampling_params.token_mask is not None
        or r.sampling_params.has_penalties
        or r.num_output_tokens < r.sampling_params.min_tokens
        for r in requests
    )


def _raw_logprobs(logits: torch.Tensor, requests: Sequence[Request]) -> dict[int, torch.Tensor]:
    """The model's own log-probabilities of the rows that asked for logprobs, by row."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not rows:
        return {}
    values = logits[_index(rows, logits)].to(torch.float32).log_softmax(dim=-1)
    return dict(zip(rows, values, strict=True))


def _token_logprobs(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    chosen = float(row[token_id])
    rank = int((row > row[token_id]).sum()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = row.topk(num_top)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id, chosen, rank, top)


def _apply_masks(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    for i, request in enumerate(requests):
        hook = request.sampling_params.token_mask
        if hook is None:
            continue
        allowed = hook(request.output_token_ids)
        if allowed is not None:
            logits[i].masked_fill_(~allowed.to(logits.device), float("-inf"))
    return logits


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Repetition penalty on every token of the prompt and output, then presence and frequency penalties on the
    output's tokens: only those positions are read and written, all rows at once."""
    params = [r.sampling_params for r in requests]
    repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    counted = [
        i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and requests[i].output_token_ids
    ]
    flat, vocab = logits.view(-1), logits.shape[-1]  # (B * V,): position = row * V + token id
    if repeated:
        positions = _flat_positions([requests[i].all_token_ids for i in repeated], repeated, vocab, logits).unique()
        penalty = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[positions // vocab]
        values = flat[positions]
        flat[positions] = torch.where(values > 0, values / penalty, values * penalty)
    if counted:
        ids = _flat_positions([requests[i].output_token_ids for i in counted], counted, vocab, logits)
        positions, counts = ids.unique(return_counts=True)
        row = positions // vocab
        frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[row]
        presence = torch.tensor([p.presence_penalty for p in params], device=logits.device)[row]
        flat[positions] -= frequency * counts.to(flat.dtype) + presence
    return logits


def _flat_positions(token_lists: list[list[int]], rows: list[int], vocab: int, like: torch.Tensor) -> torch.Tensor:
    """Each row's tokens as positions in the flattened (B * V,) logits, concatenated."""
    return torch.cat(
        [torch.tensor(tokens, dtype=torch.long) + row * vocab for tokens, row in zip(token_lists, rows, strict=True)]
    ).to(like.device)


def _apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    for i, request in enumerate(requests):
        params = request.sampling_params
        # a grammar decides when the output may end (it may allow nothing but EOS): min_tokens yields to it
        if request.num_output_tokens >= params.min_tokens or params.structured_output is not None:
            continue
        blocked = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
        if blocked:
            logits[i, blocked] = float("-inf")
    return logits
