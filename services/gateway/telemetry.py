"""Metrics, the one log line and the one usage record per finished request, kept out of the pipeline: front ends
report what happened to a RequestRecord, which exports it. Nothing here sees the API key or the prompt's text.

A request whose key was accepted (it has a principal) ends in exactly one UsageRecord handed to the usage ledger
(tenancy/ledger.py), whatever the way it ends: `finish` runs once."""

from __future__ import annotations

import time

from mesh import tracing
from mesh.logging import get_logger
from mesh.metrics import (
    GATEWAY_E2E,
    GATEWAY_IN_FLIGHT,
    GATEWAY_ITL,
    GATEWAY_REQUESTS,
    GATEWAY_TOKENS,
    GATEWAY_TTFT,
    REQUEST_E2E,
    REQUEST_GENERATION_TOKENS,
    REQUEST_ITL,
    REQUEST_PROMPT_TOKENS,
    REQUEST_TTFT,
)
from mesh.pb import common_pb2, events_pb2
from services.gateway.chat import ChatRun
from services.gateway.pipeline import GenerationStream, Usage
from services.gateway.tenancy.ledger import UsagePublisher
from services.gateway.tenancy.metric_labels import TenantLabels
from services.gateway.tenancy.principal import Principal

log = get_logger("services.gateway.requests")
VLLM_NAMED = (REQUEST_TTFT, REQUEST_ITL, REQUEST_E2E, REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS)
UNKNOWN_MODEL = "unknown"  # the label for requests refused before their model was known (bounds cardinality)
# the GenAI conventions' gen_ai.operation.name of each API
OPERATIONS = {"completions": "text_completion"}


def forget_tenant(name: str) -> None:
    """Remove every series of the tenant label `name` (it left the named tenants: metric_labels.py)."""
    by_model_name = ("model_name", "tenant")
    for metric, label_names in (
        (GATEWAY_REQUESTS, ("api", "model", "code", "tenant")),
        (GATEWAY_TOKENS, ("model", "tenant", "kind")),
        *((histogram, by_model_name) for histogram in VLLM_NAMED),
    ):
        found = {
            tuple(sample.labels[label] for label in label_names)
            for family in metric.collect()
            for sample in family.samples
            if sample.labels.get("tenant") == name
        }
        for label_values in found:
            metric.remove(*label_values)


TENANT_LABELS = TenantLabels(20, forget_tenant)  # process-wide, as the metrics are; server.py sets its capacity
CLIENT_GONE = 499  # the code of a client that left before the end (nginx's convention)
# a gRPC status's HTTP equivalent, for the usage record's http_status
_GRPC_HTTP = {
    "OK": 200,
    "CANCELLED": CLIENT_GONE,
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def finish_reason_name(reason: int) -> str:
    """common_pb2.FinishReason as the GenAI conventions spell it: stop, length, abort ("" while unfinished)."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower().replace("unspecified", "")


def http_status(code: int | str) -> int:
    """An HTTP status, or a gRPC status name, as an HTTP status (an unknown gRPC status: 500)."""
    return code if isinstance(code, int) else _GRPC_HTTP.get(code, 500)


def usage_status(status: int) -> str:
    """The ledger's word for how a request ended, from the HTTP status the client got."""
    if status == 200:
        return "finished"
    if status == CLIENT_GONE:
        return "client_gone"
    if status == 504:
        return "timeout"
    return "refused" if 400 <= status < 500 else "failed"


class RequestRecord:
    def __init__(
        self,
        api: str,
        request_id: str,
        principal: Principal | None = None,
        ledger: UsagePublisher | None = None,
    ) -> None:
        self.api = api
        self.request_id = request_id
        self.model = UNKNOWN_MODEL
        self.principal = principal  # None: no accepted key, so no usage record
        self.run: ChatRun | None = None  # set once the turn started: its usage and workers
        self._ledger = ledger
        self._started_at = time.time()
        self._arrival = time.monotonic()
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._is_admitted = False
        self._is_finished = False
        self._tenant_label: str | None = None
        self._span = tracing.current_span()  # the request's root span (a no-op one when tracing is off)

    def admit(self, model: str) -> None:
        """The request names a served model and is being worked on."""
        self.model = model
        self._is_admitted = True
        GATEWAY_IN_FLIGHT.labels(model).inc()
        if self._span.is_recording():
            operation = OPERATIONS.get(self.api, "chat")
            self._span.update_name(f"{operation} {model}")
            attributes = {
                tracing.GEN_AI_OPERATION: operation,
                tracing.GEN_AI_SYSTEM: tracing.SYSTEM,
                tracing.GEN_AI_MODEL: model,
            }
            if self.principal is not None:
                attributes[tracing.TENANT] = self.principal.tenant_name
            self._span.set_attributes(attributes)

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._last_token_at is None:
            self._first_token_at = now
            GATEWAY_TTFT.labels(self.model).observe(now - self._arrival)
            REQUEST_TTFT.labels(self.model, self.tenant_label).observe(now - self._arrival)
        else:
            gap = (now - self._last_token_at) / num_tokens  # a batch of n tokens: n gaps of equal share
            itl = REQUEST_ITL.labels(self.model, self.tenant_label)
            for _ in range(num_tokens):
                GATEWAY_ITL.labels(self.model).observe(gap)
                itl.observe(gap)
        self._last_token_at = now

    @property
    def tenant_label(self) -> str:
        """The tenant as metrics name it (bounded: TENANT_LABELS), chosen once per request (choosing counts it)."""
        if self._tenant_label is None:
            self._tenant_label = TENANT_LABELS.label(self.principal.tenant_name if self.principal else None)
        return self._tenant_label

    def start(self, run: ChatRun) -> None:
        """The request started generating: the ledger hears of it now, so that it is settled even if this
        gateway dies before `finish` (tenancy/abandoned.py)."""
        self.run = run
        if self._ledger is not None and self.principal is not None:
            record = self.usage_record(0, time.monotonic() - self._arrival)
            self._ledger.submit_open(record)

    @property
    def stream(self) -> GenerationStream | None:
        return self.run.choices[0].stream if self.run is not None else None

    def finish(self, code: int | str) -> None:
        """Once per request: `code` is the HTTP status (or gRPC status name) the client got."""
        if self._is_finished:
            return
        self._is_finished = True
        latency = time.monotonic() - self._arrival
        tenant = self.tenant_label
        GATEWAY_REQUESTS.labels(self.api, self.model, str(code), tenant).inc()
        if self._is_admitted:
            GATEWAY_IN_FLIGHT.labels(self.model).dec()
        if self._last_token_at is not None and str(code) in ("200", "OK"):
            GATEWAY_E2E.labels(self.model).observe(self._last_token_at - self._arrival)
            REQUEST_E2E.labels(self.model, tenant).observe(self._last_token_at - self._arrival)
            if self.run is not None:
                REQUEST_PROMPT_TOKENS.labels(self.model, tenant).observe(self.run.usage.prompt_tokens)
                REQUEST_GENERATION_TOKENS.labels(self.model, tenant).observe(self.run.usage.completion_tokens)
        if self.run is not None:
            usage = self.run.usage
            for kind, num_tokens in (
                ("prompt", usage.prompt_tokens),
                ("cached", usage.cached_tokens),
                ("completion", usage.completion_tokens),
            ):
                GATEWAY_TOKENS.labels(self.model, tenant, kind).inc(num_tokens)
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
        if self._ledger is not None and self.principal is not None:
            self._ledger.submit(self.usage_record(http_status(code), latency))
        if self._span.is_recording():
            self.trace(http_status(code))

    def trace(self, status: int) -> None:
        """The GenAI conventions' usage and finish reasons on the request's span; an error status past 5xx."""
        attributes: dict[str, str | int | list[str]] = {"kvmesh.status_code": status}
        if self.run is not None:
            usage = self.run.usage
            reasons = [finish_reason_name(choice.stream.finish_reason) for choice in self.run.choices]
            attributes.update(
                {
                    tracing.GEN_AI_INPUT_TOKENS: usage.prompt_tokens,
                    tracing.GEN_AI_OUTPUT_TOKENS: usage.completion_tokens,
                    tracing.CACHED_TOKENS: usage.cached_tokens,
                    tracing.GEN_AI_FINISH_REASONS: reasons,
                    "kvmesh.prefill_worker_id": self.run.placement.prefill_worker,
                    "kvmesh.decode_worker_id": self.run.placement.decode_worker,
                    "kvmesh.num_migrations": sum(choice.stream.num_migrations for choice in self.run.choices),
                }
            )
        self._span.set_attributes(attributes)
        if status >= 500:
            tracing.mark_error(self._span, f"HTTP {status}")

    def usage_record(self, status: int, latency_s: float) -> events_pb2.UsageRecord:
        """What the ledger keeps of this request: the usage of every choice as far as it got."""
        assert self.principal is not None, "only a request with an accepted key is billed"
        run = self.run
        usage = run.usage if run is not None else Usage(0, 0, 0)
        record = events_pb2.UsageRecord(
            request_id=self.request_id,
            tenant_id=self.principal.tenant_id,
            key_id=self.principal.key_id,
            model=self.model,
            api=self.api,
            status=usage_status(status),
            http_status=status,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            e2e_ms=latency_s * 1000,
            prefill_worker=run.placement.prefill_worker if run is not None else "",
            decode_worker=run.placement.decode_worker if run is not None else "",
            started_at_ms=int(self._started_at * 1000),
            ended_at_ms=int((self._started_at + latency_s) * 1000),
        )
        if self._first_token_at is not None:
            record.ttft_ms = (self._first_token_at - self._arrival) * 1000
        return record
