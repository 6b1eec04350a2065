"""A request inside the engine: its tokens, progress and state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine_core.kv_cache.block_hash import BlockHash, KeySpan
from engine_core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)computation
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    IMPORTING = "importing"  # holds KV blocks whose bytes are still arriving (KV import); not scheduled
    FINISHED_STOPPED = "stop"  # EOS or a stop token
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (from the model's raw distribution) at one generated position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # the top-N (token id, logprob), most likely first


@dataclass(frozen=True, eq=False)
class EmbeddingSpan:
    """Prompt positions whose input embeddings are given instead of looked up from their token ids: an image's
    embeddings from the vision encoder, at its placeholder tokens. They replace the token embeddings whenever
    those positions are computed (prefill, its chunks, a recompute after preemption); decode never needs them.
    `key` (the image's content hash) enters the key of every block the span touches (block_hash.KeySpan)."""

    offset: int  # the first prompt position it covers
    embeddings: torch.Tensor  # (num_tokens, hidden_size), any float dtype: cast to the model's when used
    key: bytes

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def key_span(self) -> KeySpan:
        return KeySpan(self.offset, self.end, self.key)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_seq: int  # FCFS order: lower arrived first; set by the engine
    eos_token_ids: tuple[int, ...] = ()
    cache_root: BlockHash = b""  # the parent key of the first block (model + cache salt)
    keep_kv: bool = False  # keep the blocks after finishing, until released (KV export)
    max_total_tokens: int = 0  # context limit for this request (prompt + output)
    embedding_spans: tuple[EmbeddingSpan, ...] = ()  # sorted by offset, disjoint, inside the prompt

    # -- written by the scheduler ---------------------------------------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not scheduled yet)
    first_scheduled_at: float | None = None  # time.monotonic() at its first scheduling: its queue time ends
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    # -- written by the KV cache manager --------------------------------------------------------------
    block_hashes: list[BlockHash] = field(default_factory=list)  # keys of this request's full blocks

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def key_spans(self) -> list[KeySpan]:
        return [span.key_span for span in self.embedding_spans]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def stop_reason(self) -> RequestStatus | None:
        """Whether the last appended token ends the request, and how."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens and (
            (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
