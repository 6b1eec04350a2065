"""Metrics and the one log line per finished request, kept out of the pipeline: front ends report what
happened to a RequestRecord, which exports it. Nothing here sees the API key or the prompt's text."""

from __future__ import annotations

import time

from mesh.logging import get_logger
from mesh.metrics import GATEWAY_E2E, GATEWAY_IN_FLIGHT, GATEWAY_ITL, GATEWAY_REQUESTS, GATEWAY_TTFT
from services.gateway.pipeline import GenerationStream

log = get_logger("services.gateway.requests")
UNKNOWN_MODEL = "unknown"  # the label for requests refused before their model was known (bounds cardinality)


class RequestRecord:
    def __init__(self, api: str, request_id: str) -> None:
        self.api = api
        self.request_id = request_id
        self.model = UNKNOWN_MODEL
        self.stream: GenerationStream | None = None
        self._arrival = time.monotonic()
        self._last_token_at: float | None = None
        self._is_admitted = False
        self._is_finished = False

    def admit(self, model: str) -> None:
        """The request names a served model and is being worked on."""
        self.model = model
        self._is_admitted = True
        GATEWAY_IN_FLIGHT.labels(model).inc()

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._last_token_at is None:
            GATEWAY_TTFT.labels(self.model).observe(now - self._arrival)
        else:
            gap = (now - self._last_token_at) / num_tokens  # a batch of n tokens: n gaps of equal share
            for _ in range(num_tokens):
                GATEWAY_ITL.labels(self.model).observe(gap)
        self._last_token_at = now

    def finish(self, code: int | str) -> None:
        """Once per request: `code` is the HTTP status (or gRPC status name) the client got."""
        if self._is_finished:
            return
        self._is_finished = True
        latency = time.monotonic() - self._arrival
        GATEWAY_REQUESTS.labels(self.api, self.model, str(code)).inc()
        if self._is_admitted:
            GATEWAY_IN_FLIGHT.labels(self.model).dec()
        if self._last_token_at is not None and str(code) in ("200", "OK"):
            GATEWAY_E2E.labels(self.model).observe(self._last_token_at - self._arrival)
        stream = self.stream
        log.info(
            "request finished",
            request_id=self.request_id,
            api=self.api,
            model=self.model,
            code=str(code),
            latency_s=round(latency, 4),
            prefill_worker=stream.placement.prefill_worker if stream else None,
            decode_worker=stream.placement.decode_worker if stream else None,
            prompt_tokens=stream.num_prompt_tokens if stream else None,
            cached_tokens=stream.num_cached_tokens if stream else None,
            completion_tokens=stream.num_completion_tokens if stream else None,
        )
