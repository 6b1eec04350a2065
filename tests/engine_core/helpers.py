"""Builders for engine objects in tests that need no model."""

from __future__ import annotations

from engine_core.kv_cache.block_hash import root_hash
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams

_seq = iter(range(10**9))


def make_request(
    request_id: str,
    prompt: list[int],
    params: SamplingParams | None = None,
    *,
    salt: str | None = None,
    eos: tuple[int, ...] = (2,),
    max_total_tokens: int = 1024,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params or SamplingParams(max_tokens=4),
        arrival_seq=next(_seq),
        eos_token_ids=eos,
        cache_root=root_hash("test-model", salt),
        max_total_tokens=max_total_tokens,
    )
