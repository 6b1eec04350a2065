"""What a client is told about its limits: the binding request and token windows, as OpenAI's `x-ratelimit-*`
headers, Anthropic's `anthropic-ratelimit-*` headers, or gRPC metadata (the same names as OpenAI's).

Imports nothing from the gateway: errors.py carries these facts in a refusal, and limits.py computes them.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

CLAMPED_HEADER = "x-kvmesh-max-tokens-clamped"  # the lower max_tokens ceiling a partly fitting request got


@dataclass(frozen=True)
class RateLimitFacts:
    """The most constraining request window (requests per minute) and token window (minute, day or month) over
    the tenant's and the key's limits, after this request's reservation. None: no limit of that kind."""

    now: float  # epoch seconds when the facts were taken: the resets below count from it
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    retry_after_s: float | None = None  # set on a refusal: when the refused demand could first fit
    max_tokens_clamped: int | None = None  # set when the request was admitted with a lower max_tokens ceiling

    def openai_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.limit_requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limit_requests)
            headers["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            headers["x-ratelimit-reset-requests"] = duration(self.reset_requests_s or 0.0)
        if self.limit_tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            headers["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            headers["x-ratelimit-reset-tokens"] = duration(self.reset_tokens_s or 0.0)
        return {**headers, **self._common()}

    def anthropic_headers(self) -> dict[str, str]:
        """Anthropic's: limits, remaining, and resets as RFC 3339 times."""
        headers: dict[str, str] = {}
        if self.limit_requests is not None:
            headers["anthropic-ratelimit-requests-limit"] = str(self.limit_requests)
            headers["anthropic-ratelimit-requests-remaining"] = str(self.remaining_requests)
            headers["anthropic-ratelimit-requests-reset"] = self._at(self.reset_requests_s)
        if self.limit_tokens is not None:
            headers["anthropic-ratelimit-tokens-limit"] = str(self.limit_tokens)
            headers["anthropic-ratelimit-tokens-remaining"] = str(self.remaining_tokens)
            headers["anthropic-ratelimit-tokens-reset"] = self._at(self.reset_tokens_s)
        return {**headers, **self._common()}

    def _common(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.max_tokens_clamped is not None:
            headers[CLAMPED_HEADER] = str(self.max_tokens_clamped)
        return headers

    def _at(self, seconds: float | None) -> str:
        moment = datetime.datetime.fromtimestamp(self.now + (seconds or 0.0), tz=datetime.UTC)
        return moment.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1.5s`, `6m0s`, `2h3m4s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"
