"""The REST app (aiohttp): the API key, request ids and error bodies for every route, the shared machinery of
a generation endpoint (admission, the stream writer), and the plain routes: /v1/models, /openapi.json,
/healthz, /readyz, /metrics. The APIs themselves live beside it:

    openai_http.py     /v1/chat/completions, /v1/completions
    responses_api.py   /v1/responses (stored responses in NATS JetStream KV: response_store.py)
    anthropic_api.py   /v1/messages

Every response carries x-request-id; a served one also x-kvmesh-prefill-worker and x-kvmesh-decode-worker,
known before the first byte since routing and prefill come first. A client that leaves cancels its handler
(handler_cancellation), which cancels the Prefill call or the Decode.Stream call in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mesh.logging import bind_request_id, get_logger
from services.gateway.auth import bearer_key
from services.gateway.chat import ChatRun, ChatTurn, start_chat
from services.gateway.core import GatewayCore, echoed_request_id, new_request_id
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.openapi import openapi_document
from services.gateway.response_store import ResponseStore
from services.gateway.telemetry import RequestRecord

log = get_logger(__name__)

CORE_KEY = web.AppKey("core", GatewayCore)
STORE_KEY = web.AppKey("response_store", ResponseStore)
STARTED_AT_KEY = web.AppKey("started_at", float)  # the `created` of every model in /v1/models
REQUEST_ID = web.RequestKey("request_id", str)  # the id the mesh knows the request by
ECHOED_ID = web.RequestKey("echoed_request_id", str)  # what x-request-id says back
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
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HTTP_ERRORS = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED, 413: ErrorKind.TOO_LARGE}


def is_anthropic(request: web.Request) -> bool:
    return request.path.startswith(ANTHROPIC_PREFIX)


def error_response(request: web.Request, error: GatewayError) -> web.Response:
    """The error in the shape of the API the client called: OpenAI's, or Anthropic's on /v1/messages."""
    headers = {"x-request-id": request[ECHOED_ID], **error.http_headers()}
    if is_anthropic(request):
        return web.json_response(error.anthropic_body(), status=error.anthropic_status, headers=headers, dumps=dumps)
    return web.json_response(error.body(), status=error.http_status, headers=headers, dumps=dumps)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def served_headers(request: web.Request, run: ChatRun) -> dict[str, str]:
    return {
        "x-request-id": request[ECHOED_ID],
        "x-kvmesh-prefill-worker": run.placement.prefill_worker,
        "x-kvmesh-decode-worker": run.placement.decode_worker,
        # the engine's prefill time, so a client can tell the mesh's overhead from compute
        "server-timing": f"prefill;dur={run.prefill_seconds * 1000:.3f}",
    }


def presented_key(request: web.Request) -> str | None:
    """OpenAI clients send `Authorization: Bearer <key>`, Anthropic's `x-api-key: <key>`; either works."""
    return bearer_key(request.headers.get("Authorization")) or request.headers.get("x-api-key") or None


@web.middleware
async def api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request ids, the API key on /v1, and error bodies for whatever escapes a handler."""
    client_id = request.headers.get("x-request-id")
    request[REQUEST_ID] = new_request_id(client_id)
    request[ECHOED_ID] = echoed_request_id(client_id, request[REQUEST_ID])
    with bind_request_id(request[REQUEST_ID]):
        if request.path.startswith("/v1/") and not request.app[CORE_KEY].keys.is_valid(presented_key(request)):
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
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(ErrorKind.TOO_LARGE, f"the request body is over {MAX_BODY_BYTES} bytes") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise invalid(None, "We could not parse the JSON body of your request: it must be a JSON object.") from None


# ---- a generation endpoint's life ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def admitted(request: web.Request, api: str) -> AsyncIterator[RequestRecord]:
    """Count the request as in flight (refused while draining) and record how it ended."""
    record = RequestRecord(api, request[REQUEST_ID])
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
    run = await start_chat(core, turn, request[REQUEST_ID], record.on_tokens)
    record.stream = run.choices[0].stream
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


# ---- plain routes ------------------------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    created = int(request.app[STARTED_AT_KEY])
    data = [
        {
            "id": model.name,
            "object": "model",
            "created": created,
            "owned_by": "kvmesh",
            "max_model_len": model.context_len,
        }
        for model in core.served_models()
    ]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    name = request.match_info["model"]
    if name not in {model.name for model in core.served_models()}:
        raise GatewayError(ErrorKind.MODEL_NOT_FOUND, f"the model {name!r} does not exist", "model")
    model = core.catalog.require(name)
    return web.json_response(
        {
            "id": model.name,
            "object": "model",
            "created": int(request.app[STARTED_AT_KEY]),
            "owned_by": "kvmesh",
            "max_model_len": model.context_len,
        }
    )


async def openapi_json(_: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    if request.app[CORE_KEY].is_ready():
        return web.Response(text="ready\n")
    return web.Response(status=503, text="not ready: no balancer, or no model with prefill and decode workers\n")


async def metrics(_: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(core: GatewayCore, store: ResponseStore | None = None) -> web.Application:
    from services.gateway import anthropic_api, mesh_workers, openai_http, responses_api

    app = web.Application(middlewares=[api_middleware], client_max_size=MAX_BODY_BYTES)
    app[CORE_KEY] = core
    app[STORE_KEY] = store or ResponseStore(None)
    app[STARTED_AT_KEY] = time.time()
    app.router.add_post(openai_http.CHAT_PATH, openai_http.chat_completions)
    app.router.add_post(openai_http.COMPLETIONS_PATH, openai_http.completions)
    app.router.add_post(responses_api.RESPONSES_PATH, responses_api.create_response)
    app.router.add_get(responses_api.RESPONSES_PATH + "/{response_id}", responses_api.get_response)
    app.router.add_delete(responses_api.RESPONSES_PATH + "/{response_id}", responses_api.delete_response)
    app.router.add_post(anthropic_api.MESSAGES_PATH, anthropic_api.create_message)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get(mesh_workers.MESH_WORKERS_PATH, mesh_workers.list_mesh_workers)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


async def start_http(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app`; returns the runner (to clean up) and the bound port. A client that disconnects cancels
    its handler, which is what cancels the gRPC calls made for it."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    bound = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
    return runner, bound
