"""The REST plumbing every API shares: request ids and the API key (the middleware), reading a JSON body, the
one mapping of errors to the body shape of the API the client called, and a generation endpoint's life:
admission, starting the chat turn, the served headers and the SSE writer. The app's keys live here too, so the
API modules import this and http_app imports them: no cycle.

Every response carries x-request-id; a served one also x-kvmesh-gateway-worker, x-kvmesh-prefill-worker and
x-kvmesh-decode-worker,
known before the first byte since routing and prefill come first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from mesh import tracing
from mesh.logging import bind_request_id, get_logger
from services.gateway.auth import bearer_key
from services.gateway.body_shape import check_body_shape
from services.gateway.chat import ChatRun, ChatTurn, start_chat
from services.gateway.core import GatewayCore, check_scope, echoed_request_id, new_request_id
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.response_store import ResponseStore
from services.gateway.telemetry import RequestRecord
from services.gateway.tenancy.principal import Principal

log = get_logger(__name__)

CORE_KEY = web.AppKey("core", GatewayCore)
STORE_KEY = web.AppKey("response_store", ResponseStore)
PUBLIC_METRICS_KEY = web.AppKey("public_metrics", bool)  # /metrics with no key (gateway setting public_metrics)
STARTED_AT_KEY = web.AppKey("started_at", float)  # the `created` of every model in /v1/models
REQUEST_ID = web.RequestKey("request_id", str)  # the id the mesh knows the request by
ECHOED_ID = web.RequestKey("echoed_request_id", str)  # what x-request-id says back
PRINCIPAL = web.RequestKey("principal", Principal)  # who sent it: set for every request with a valid key
MAX_BODY_BYTES = 8 * 2**20
TRAFFIC_CLASS_HEADER = "x-kvmesh-traffic-class"  # agent | chat | ...: the TTL class of the request's KV in the store
CLIENT_GONE = 499  # the metrics' code for a client that left before the end (nginx's convention)
ANTHROPIC_PREFIX = "/v1/messages"
API_NAMES = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
ADMIN_ONLY_PATHS = frozenset({"/v1/mesh/workers"})  # checked by their handlers: the admin key, no tenant key
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HTTP_ERRORS = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED, 413: ErrorKind.TOO_LARGE}


def is_anthropic(request: web.Request) -> bool:
    return request.path.startswith(ANTHROPIC_PREFIX)


def error_response(request: web.Request, error: GatewayError) -> web.Response:
    """The error in the shape of the API the client called: OpenAI's, or Anthropic's on /v1/messages."""
    if is_anthropic(request):
        headers = {"x-request-id": request[ECHOED_ID], **error.anthropic_headers()}
        return web.json_response(error.anthropic_body(), status=error.anthropic_status, headers=headers, dumps=dumps)
    headers = {"x-request-id": request[ECHOED_ID], **error.http_headers()}
    return web.json_response(error.body(), status=error.http_status, headers=headers, dumps=dumps)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def served_headers(request: web.Request, run: ChatRun) -> dict[str, str]:
    facts = run.reservation.facts if run.reservation is not None else None
    limit_headers = {}  # what is left of the caller's limits (tenancy/limits.py), in the API's own names
    if facts is not None:
        limit_headers = facts.anthropic_headers() if is_anthropic(request) else facts.openai_headers()
    return {
        "x-request-id": request[ECHOED_ID],
        "x-kvmesh-prefill-worker": run.placement.prefill_worker,
        "x-kvmesh-decode-worker": run.placement.decode_worker,
        "x-kvmesh-gateway-worker": request.app[CORE_KEY].worker_id,  # which replica: they share one port
        # the engine's prefill time, so a client can tell the mesh's overhead from compute
        "server-timing": f"prefill;dur={run.prefill_seconds * 1000:.3f}",
        **limit_headers,
    }


def presented_key(request: web.Request) -> str | None:
    """OpenAI clients send `Authorization: Bearer <key>`, Anthropic's `x-api-key: <key>`; either works."""
    return bearer_key(request.headers.get("Authorization")) or request.headers.get("x-api-key") or None


@web.middleware
async def api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request ids, the request's span, the API key on /v1, and error bodies for whatever escapes a handler."""
    client_id = request.headers.get("x-request-id")
    request[REQUEST_ID] = new_request_id(client_id)
    request[ECHOED_ID] = echoed_request_id(client_id, request[REQUEST_ID])
    with bind_request_id(request[REQUEST_ID]), server_span(request) as span:
        response = await _answer(request, handler)
        span.set_attribute("http.response.status_code", response.status)
        return response


def server_span(request: web.Request) -> contextlib.AbstractContextManager[tracing.Span]:
    """An API request's root span (a child of the client's traceparent, if it sent one); RequestRecord names it
    by the GenAI conventions once the model is known. Probes and scrapes are not traced."""
    if not tracing.is_enabled() or not request.path.startswith("/v1/"):
        return contextlib.nullcontext(tracing.current_span())
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "/v1/*"  # a bounded name: the route, not the path
    attributes = {"http.request.method": request.method, "http.route": route, tracing.REQUEST_ID: request[REQUEST_ID]}
    parent = tracing.context_from(request.headers)
    return tracing.span(f"{request.method} {route}", tracing.SpanKind.SERVER, attributes, parent)


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        principal = await request.app[CORE_KEY].authenticate(presented_key(request))
    except GatewayError as unreadable:  # the key store cannot be read: a 503, never a 401 for a valid key
        return error_response(request, unreadable)
    if principal is not None:
        request[PRINCIPAL] = principal
    elif request.path.startswith("/v1/") and request.path not in ADMIN_ONLY_PATHS:
        error = GatewayError(
            ErrorKind.INVALID_API_KEY,
            "Missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key'.",
        )
        if request.path in API_NAMES:  # a fixed set: metric labels stay bounded
            RequestRecord(API_NAMES[request.path], request[REQUEST_ID]).finish(error.http_status)
        return error_response(request, error)
    try:
        response = await handler(request)
    except GatewayError as error:
        return error_response(request, error)
    except web.HTTPException as exc:  # the router's 404 and 405, a body over MAX_BODY_BYTES
        return http_error_response(request, exc)
    except Exception:
        log.exception("unhandled error")
        return error_response(request, GatewayError(ErrorKind.INTERNAL, "internal error"))
    if not response.prepared:
        response.headers.setdefault("x-request-id", request[ECHOED_ID])
    return response


def http_error_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors in the API's error shape; a 405 names the methods the route takes (RFC 9110)."""
    kind = _HTTP_ERRORS.get(exc.status, ErrorKind.INVALID_REQUEST)
    response = error_response(request, GatewayError(kind, exc.reason))
    if isinstance(exc, web.HTTPMethodNotAllowed):
        response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
    return response


async def json_body(request: web.Request) -> Any:
    """The body, parsed and its shape checked (body_shape.py). A compressed body is refused unread: the listener
    does not inflate bodies (aiohttp inflated a refused 1 MiB gzip to its 1 GiB end: 3 s with the loop blocked),
    and no API client compresses requests."""
    if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
        raise invalid(None, "a compressed request body (Content-Encoding) is not accepted: send it uncompressed")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(ErrorKind.TOO_LARGE, f"the request body is over {MAX_BODY_BYTES} bytes") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise invalid(None, "We could not parse the JSON body of your request: it must be a JSON object.") from None
    check_body_shape(body)
    return body


# ---- a generation endpoint's life ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def admitted(request: web.Request, api: str) -> AsyncIterator[RequestRecord]:
    """Count the request as in flight (refused while draining) and record how it ended."""
    record = RequestRecord(api, request[REQUEST_ID], request.get(PRINCIPAL), request.app[CORE_KEY].ledger)
    try:
        with request.app[CORE_KEY].track():
            yield record
    except GatewayError as error:
        record.finish(error.http_status)
        raise
    except asyncio.CancelledError:
        record.finish(CLIENT_GONE)
        raise
    except Exception:
        record.finish(500)
        raise


async def start_turn(request: web.Request, turn: ChatTurn, record: RequestRecord) -> ChatRun:
    core = request.app[CORE_KEY]
    if TRAFFIC_CLASS_HEADER in request.headers:  # every REST API: the KV store's TTL class for this request
        turn = dataclasses.replace(turn, traffic_class=request.headers[TRAFFIC_CLASS_HEADER])
    record.admit(core.catalog.require(turn.model).name)
    check_scope(request.get(PRINCIPAL), API_NAMES.get(request.path, request.path), turn.model)
    run = await start_chat(core, turn, request[REQUEST_ID], record.on_tokens, request.get(PRINCIPAL))
    record.start(run)
    return run


async def stream_response(
    request: web.Request,
    run: ChatRun,
    record: RequestRecord,
    frames: AsyncIterator[bytes],
    error_frame: Callable[[GatewayError], bytes],
) -> web.StreamResponse:
    """Server-sent events. Once the status line is out, an error goes in the stream as the API's error
    frame (which the SDKs raise) and the stream ends: never a silently truncated stream."""
    response = web.StreamResponse(
        headers={
            **served_headers(request, run),
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    code: int = 200
    try:
        async for frame in frames:
            await response.write(frame)
    except GatewayError as error:
        code = error.http_status
        await _write_quietly(response, error_frame(error))
    except ConnectionResetError:
        code = CLIENT_GONE
    except Exception:
        log.exception("stream failed")
        code = 500
        await _write_quietly(response, error_frame(GatewayError(ErrorKind.INTERNAL, "internal error")))
    record.finish(code)
    if code != CLIENT_GONE:
        await _write_eof_quietly(response)
    return response


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionResetError):
        await response.write(data)


async def _write_eof_quietly(response: web.StreamResponse) -> None:
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
