"""How one request's tokens are chosen, in the shape vLLM users know. Validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_core.structured_output import StructuredOutput, TokenMaskFn

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names it (as the OpenAI API would)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means all tokens
    min_p: float = 0.0
    seed: int | None = None  # same seed, same tokens, whatever else shares the batch
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N: the chosen token's logprob plus the top N
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # a grammar every sampled token must follow; the engine turns it into `token_mask` when the request is added
    structured_output: StructuredOutput | None = None
    token_mask: TokenMaskFn | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        _check(self.temperature, "temperature", 0.0, 100.0)
        _check(self.top_p, "top_p", 0.0, 1.0, low_open=True)
        _check(self.min_p, "min_p", 0.0, 1.0)
        _check(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check(self.repetition_penalty, "repetition_penalty", 0.0, 10.0, low_open=True)
        _check_int(self.top_k, "top_k", 0)
        _check_int(self.min_tokens, "min_tokens", 0)
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", 1)
            if self.min_tokens > self.max_tokens:
                raise SamplingParamsError("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.seed is not None:
            _check_int(self.seed, "seed", -(2**63))
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs", 0)
            if self.logprobs > MAX_LOGPROBS:
                raise SamplingParamsError("logprobs", f"at most {MAX_LOGPROBS}, got {self.logprobs}")
        for token_id in self.stop_token_ids:
            _check_int(token_id, "stop_token_ids", 0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


def _check(value: float, name: str, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise SamplingParamsError(name, f"must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise SamplingParamsError(name, f"must be in {bracket}{low}, {high}], got {value}")


def _check_int(value: int, name: str, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamsError(name, f"must be an integer, got {value!r}")
    if value < low:
        raise SamplingParamsError(name, f"must be at least {low}, got {value}")
