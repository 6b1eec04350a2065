"""Turns a batch of logits into next tokens, request by request.

Order of operations (as vLLM and transformers apply them): token masks, penalties, min_tokens, then
greedy argmax or temperature -> top-k -> top-p -> min-p -> a draw. Logprobs come from the model's raw
distribution, before any of these.

Random draws use the exponential race (argmax of p / q with q ~ Exp(1)), which samples from p exactly.
A seeded request draws its q from a generator seeded by (seed, output position), so its tokens depend
only on its own logits: the same seed gives the same tokens whatever else is in the batch, and the
stream continues identically after a preemption or after its KV moved to another engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_core.request import Request, TokenLogprobs

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the generator's seed space


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)  # draws of unseeded requests

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits (B, V), one row per request (any float dtype, any device)."""
        logits = logits.to(torch.float32, copy=True)  # our own copy: masks and penalties write it in place
        raw_logprobs = _raw_logprobs(logits, requests)
        logits = _apply_masks(logits, requests)
        logits = _apply_penalties(logits, requests)
        logits = _apply_min_tokens(logits, requests)
        token_ids = self._choose(logits, requests)
        logprobs = [
            _token_logprobs(raw_logprobs[i], token_ids[i], r.sampling_params.logprobs)
            if raw_logprobs is not None and r.sampling_params.logprobs is not None
            else None
            for i, r in enumerate(requests)
        ]
        return SamplerOutput(token_ids, logprobs)

    def _choose(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if not random_rows:
            return greedy
        subset = [requests[i] for i in random_rows]
        probs = _filtered_probs(logits[random_rows], subset)  # (b, V)
        noise = torch.stack([self._exponential(r, probs.shape[-1]) for r in subset]).to(probs.device)
        drawn = (probs / noise).argmax(dim=-1).tolist()
        for row, token in zip(random_rows, drawn, strict=True):
            greedy[row] = token
        return greedy

    def _exponential(self, request: Request, vocab_size: int) -> torch.Tensor:
        seed = request.sampling_params.seed
        generator = self._generator
        if seed is not None:
            position = request.num_output_tokens
            generator = torch.Generator().manual_seed((seed * _MIX + position) % 2**63)
        return torch.empty(vocab_size).exponential_(generator=generator)


def _filtered_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    params = [r.sampling_params for r in requests]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (b, V)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # keep the smallest prefix whose mass reaches top_p (the token crossing the line is kept)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _raw_logprobs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor | None:
    if all(r.sampling_params.logprobs is None for r in requests):
        return None
    return logits.log_softmax(dim=-1)


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
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    for i in rows:
        request, params = requests[i], requests[i].sampling_params
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if request.output_token_ids and (params.presence_penalty or params.frequency_penalty):
            ids = torch.tensor(request.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(ids, minlength=vocab).to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    return logits


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
