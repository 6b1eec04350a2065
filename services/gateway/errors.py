"""The gateway's errors and the one place they become HTTP statuses, OpenAI error bodies and gRPC codes.

Everything that can go wrong for a request ends as a GatewayError: bad input (raised by the parsers), an
unknown model, no workers, and a worker's gRPC status (`from_rpc_error`).
"""

from __future__ import annotations

import enum
from typing import Any

import grpc

from services.gateway.tenancy.ratelimit_headers import RateLimitFacts


class ErrorKind(enum.Enum):
    # (HTTP status, gRPC code, OpenAI error type, OpenAI error code)
    INVALID_REQUEST = (400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", None)
    CONTEXT_LENGTH = (400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", "context_length_exceeded")
    INVALID_API_KEY = (401, grpc.StatusCode.UNAUTHENTICATED, "invalid_request_error", "invalid_api_key")
    PERMISSION_DENIED = (403, grpc.StatusCode.PERMISSION_DENIED, "permission_error", "permission_denied")
    MODEL_NOT_FOUND = (404, grpc.StatusCode.NOT_FOUND, "invalid_request_error", "model_not_found")
    NOT_FOUND = (404, grpc.StatusCode.NOT_FOUND, "invalid_request_error", "not_found")
    METHOD_NOT_ALLOWED = (405, grpc.StatusCode.UNIMPLEMENTED, "invalid_request_error", "method_not_allowed")
    CONFLICT = (409, grpc.StatusCode.ALREADY_EXISTS, "invalid_request_error", "conflict")
    TOO_LARGE = (413, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", "request_too_large")
    RATE_LIMITED = (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error", "rate_limit_exceeded")
    # a tenant's or key's own limits (tenancy/limits.py); OpenAI names the exhausted kind in `type`
    LIMIT_REQUESTS = (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "requests", "rate_limit_exceeded")
    LIMIT_TOKENS = (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "tokens", "rate_limit_exceeded")
    LIMIT_CONCURRENCY = (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "requests", "concurrency_limit_exceeded")
    LIMIT_SPEND = (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "insufficient_quota", "insufficient_quota")
    INTERNAL = (500, grpc.StatusCode.INTERNAL, "server_error", "internal_error")
    UPSTREAM = (502, grpc.StatusCode.INTERNAL, "server_error", "upstream_error")
    UNAVAILABLE = (503, grpc.StatusCode.UNAVAILABLE, "server_error", "service_unavailable")
    TIMEOUT = (504, grpc.StatusCode.DEADLINE_EXCEEDED, "server_error", "timeout")

    @property
    def http_status(self) -> int:
        return int(self.value[0])

    @property
    def grpc_code(self) -> grpc.StatusCode:
        code: grpc.StatusCode = self.value[1]
        return code


RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class GatewayError(Exception):
    def __init__(
        self, kind: ErrorKind, message: str, param: str | None = None, rate_limit: RateLimitFacts | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.rate_limit = rate_limit  # a tenant limit's refusal: what the headers tell the client

    @property
    def http_status(self) -> int:
        return self.kind.http_status

    def body(self) -> dict[str, Any]:
        """OpenAI's error object; `code` is a string or null, never a number."""
        _, _, error_type, code = self.kind.value
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": code}}

    def http_headers(self) -> dict[str, str]:
        if self.rate_limit is not None:
            return self.rate_limit.openai_headers()
        return {"retry-after": str(RETRY_AFTER_S)} if self.kind is ErrorKind.RATE_LIMITED else {}

    def anthropic_headers(self) -> dict[str, str]:
        if self.rate_limit is not None:
            return self.rate_limit.anthropic_headers()
        return self.http_headers()

    # -- Anthropic's shape (/v1/messages) -------------------------------------------------------------
    @property
    def anthropic_status(self) -> int:
        return OVERLOADED_STATUS if self.kind is ErrorKind.RATE_LIMITED else self.http_status

    @property
    def message_naming_param(self) -> str:
        """The message, starting with the field it is about unless it names it already: for the shapes that have
        no `param` (Anthropic's errors, gRPC status details), as Anthropic's own messages do."""
        if self.param and self.param not in self.message:
            return f"{self.param}: {self.message}"
        return self.message

    def anthropic_body(self) -> dict[str, Any]:
        """`{"type": "error", "error": {"type", "message"}}`; a saturated mesh is `overloaded_error`."""
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(self.kind, "api_error"), "message": self.message_naming_param},
        }


OVERLOADED_STATUS = 529  # Anthropic's "overloaded": its SDK retries it
_ANTHROPIC_TYPES = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.CONTEXT_LENGTH: "invalid_request_error",
    ErrorKind.TOO_LARGE: "request_too_large",
    ErrorKind.METHOD_NOT_ALLOWED: "invalid_request_error",
    ErrorKind.INVALID_API_KEY: "authentication_error",
    ErrorKind.PERMISSION_DENIED: "permission_error",
    ErrorKind.MODEL_NOT_FOUND: "not_found_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.RATE_LIMITED: "overloaded_error",
    ErrorKind.LIMIT_REQUESTS: "rate_limit_error",
    ErrorKind.LIMIT_TOKENS: "rate_limit_error",
    ErrorKind.LIMIT_CONCURRENCY: "rate_limit_error",
    ErrorKind.LIMIT_SPEND: "rate_limit_error",
    ErrorKind.TIMEOUT: "timeout_error",
}


def invalid(param: str | None, message: str) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_REQUEST, message, param)


_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: ErrorKind.INVALID_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.RATE_LIMITED,
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: ErrorKind.UNAVAILABLE,  # a worker going away cancels its calls
    grpc.StatusCode.NOT_FOUND: ErrorKind.UNAVAILABLE,  # the worker lost the request or lacks the model
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.TIMEOUT,
}


def from_rpc_error(error: grpc.aio.AioRpcError, role: str) -> GatewayError:
    """A worker's status as the client sees it: the worker's message for bad input, a plain one otherwise
    (transport details name internal addresses; the pipeline logs them)."""
    kind = _FROM_GRPC.get(error.code(), ErrorKind.UPSTREAM)
    if kind is ErrorKind.INVALID_REQUEST:
        return GatewayError(kind, error.details() or f"the {role} worker rejected the request")
    if kind is ErrorKind.RATE_LIMITED:
        return GatewayError(kind, f"the {role} pool is at capacity; retry shortly")
    if kind is ErrorKind.TIMEOUT:
        return GatewayError(kind, f"the {role} worker did not answer in time")
    if kind is ErrorKind.UNAVAILABLE:
        return GatewayError(kind, f"no {role} worker is available for this request; retry shortly")
    return GatewayError(kind, f"the {role} worker failed ({error.code().name})")
