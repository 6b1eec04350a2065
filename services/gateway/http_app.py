"""The REST API (aiohttp): OpenAI's Chat Completions and model list under /v1 (Bearer key required), and
/healthz, /readyz, /metrics (no key). Handlers are thin: parse (openai_api), run (pipeline), shape back.

Every response carries x-request-id; a served one also x-kvmesh-prefill-worker and x-kvmesh-decode-worker,
known before the first byte since routing and prefill come first. A client that leaves cancels its handler
(handler_cancellation), which cancels the Prefill call or the Decode.Stream call in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mesh.logging import bind_request_id, get_logger
from services.gateway import openai_api
from services.gateway.auth import bearer_key
from services.gateway.core import GatewayCore, echoed_request_id, new_request_id
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.openai_api import FINISH_REASONS, ChatRequest, ChunkShape, sse
from services.gateway.pipeline import GenerationStream
from services.gateway.telemetry import RequestRecord

log = get_logger(__name__)

CORE_KEY = web.AppKey("core", GatewayCore)
STARTED_AT_KEY = web.AppKey("started_at", float)  # the `created` of every model in /v1/models
REQUEST_ID = web.RequestKey("request_id", str)  # the id the mesh knows the request by
ECHOED_ID = web.RequestKey("echoed_request_id", str)  # what x-request-id says back
MAX_BODY_BYTES = 8 * 2**20
CHAT_API = "chat.completions"
CHAT_PATH = "/v1/chat/completions"
CLIENT_GONE = 499  # the metrics' code for a client that left before the end (nginx's convention)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HTTP_ERRORS = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED, 413: ErrorKind.TOO_LARGE}


def error_response(request: web.Request, error: GatewayError) -> web.Response:
    headers = {"x-request-id": request[ECHOED_ID], **error.http_headers()}
    return web.json_response(error.body(), status=error.http_status, headers=headers, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _served_headers(request: web.Request, stream: GenerationStream) -> dict[str, str]:
    return {"x-request-id": request[ECHOED_ID],
            "x-kvmesh-prefill-worker": stream.placement.prefill_worker,
            "x-kvmesh-decode-worker": stream.placement.decode_worker,
            # the engine's prefill time, so a client can tell the mesh's overhead from compute
            "server-timing": f"prefill;dur={stream.prefill_seconds * 1000:.3f}"}


@web.middleware
async def api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request ids, the API key on /v1, and OpenAI error bodies for whatever escapes a handler."""
    client_id = request.headers.get("x-request-id")
    request[REQUEST_ID] = new_request_id(client_id)
    request[ECHOED_ID] = echoed_request_id(client_id, request[REQUEST_ID])
    with bind_request_id(request[REQUEST_ID]):
        if request.path.startswith("/v1/") and not request.app[CORE_KEY].keys.is_valid(
                bearer_key(request.headers.get("Authorization"))):
            error = GatewayError(ErrorKind.INVALID_API_KEY,
                                 "Missing or incorrect API key: send 'Authorization: Bearer <key>'.")
            if request.path == CHAT_PATH:
                RequestRecord(CHAT_API, request[REQUEST_ID]).finish(error.http_status)
            return error_response(request, error)
        try:
            response = await handler(request)
        except GatewayError as error:
            return error_response(request, error)
        except web.HTTPException as exc:  # the router's 404 and 405, a body over MAX_BODY_BYTES
            kind = _HTTP_ERRORS.get(exc.status, ErrorKind.INVALID_REQUEST)
            return error_response(request, GatewayError(kind, exc.reason))
        except Exception:
            log.exception("unhandled error")
            return error_response(request, GatewayError(ErrorKind.INTERNAL, "internal error"))
        if not response.prepared:
            response.headers.setdefault("x-request-id", request[ECHOED_ID])
        return response


async def _json_body(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(ErrorKind.TOO_LARGE, f"the request body is over {MAX_BODY_BYTES} bytes") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise invalid(None, "We could not parse the JSON body of your request: it must be a JSON object.") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    record = RequestRecord(CHAT_API, request[REQUEST_ID])
    try:
        chat = openai_api.parse_chat_request(await _json_body(request))
        model = core.catalog.require(chat.model)
        record.admit(model.name)
        with core.track():
            generation = core.generation(
                request[REQUEST_ID], model, model.render_chat(chat.messages), chat.sampling, chat.stop,
                chat.cache_salt, traffic_class="chat", prompt_param="messages",
                max_tokens_param=chat.max_tokens_param)
            stream = await core.pipeline.start(generation, core.deadline())
            record.stream = stream
            try:
                if chat.stream:
                    return await _stream_completion(request, chat, stream, record)
                return await _complete(request, chat, stream, record)
            finally:
                stream.close()
    except GatewayError as error:
        record.finish(error.http_status)
        raise
    except asyncio.CancelledError:
        record.finish(CLIENT_GONE)
        raise
    except Exception:
        record.finish(500)
        raise


async def _complete(request: web.Request, chat: ChatRequest, stream: GenerationStream,
                    record: RequestRecord) -> web.Response:
    texts = []
    async for delta in stream.deltas():
        record.on_tokens(len(delta.token_ids))
        texts.append(delta.text)
    body = openai_api.completion_body(f"chatcmpl-{request[REQUEST_ID]}", int(time.time()), chat.model,
                                      "".join(texts), FINISH_REASONS[stream.finish_reason], stream.usage)
    record.finish(200)
    return web.json_response(body, headers=_served_headers(request, stream), dumps=_dumps)


async def _stream_completion(request: web.Request, chat: ChatRequest, stream: GenerationStream,
                             record: RequestRecord) -> web.StreamResponse:
    shape = ChunkShape(f"chatcmpl-{request[REQUEST_ID]}", int(time.time()), chat.model, chat.include_usage)
    response = web.StreamResponse(headers={
        **_served_headers(request, stream), "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no"})
    await response.prepare(request)
    code: int = 200
    try:
        await response.write(sse(shape.role()))
        async for delta in stream.deltas():
            record.on_tokens(len(delta.token_ids))
            if delta.text:
                await response.write(sse(shape.content(delta.text)))
        await response.write(sse(shape.finish(FINISH_REASONS[stream.finish_reason])))
        if chat.include_usage:
            await response.write(sse(shape.usage(stream.usage)))
        await response.write(openai_api.SSE_DONE)
    except GatewayError as error:  # the status line is sent: the error goes in the stream, which then ends
        code = error.http_status
        await _write_quietly(response, sse(error.body()))
    except ConnectionResetError:
        code = CLIENT_GONE
    except Exception:
        log.exception("stream failed")
        code = 500
        await _write_quietly(response, sse(GatewayError(ErrorKind.INTERNAL, "internal error").body()))
    record.finish(code)
    if code != CLIENT_GONE:
        await _write_eof_quietly(response)
    return response


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        pass


async def _write_eof_quietly(response: web.StreamResponse) -> None:
    try:
        await response.write_eof()
    except ConnectionResetError:
        pass


async def list_models(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    created = int(request.app[STARTED_AT_KEY])
    data = [{"id": model.name, "object": "model", "created": created, "owned_by": "kvmesh",
             "max_model_len": model.context_len} for model in core.served_models()]
    return web.json_response({"object": "list", "data": data})


async def healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    if request.app[CORE_KEY].is_ready():
        return web.Response(text="ready\n")
    return web.Response(status=503, text="not ready: no balancer, or no model with prefill and decode workers\n")


async def metrics(_: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(core: GatewayCore) -> web.Application:
    app = web.Application(middlewares=[api_middleware], client_max_size=MAX_BODY_BYTES)
    app[CORE_KEY] = core
    app[STARTED_AT_KEY] = time.time()
    app.router.add_post(CHAT_PATH, chat_completions)
    app.router.add_get("/v1/models", list_models)
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
