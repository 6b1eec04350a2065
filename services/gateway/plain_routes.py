"""The routes that are not an API call: GET /v1/models and /v1/models/{model} (API key required, like every
/v1 route), /openapi.json, /healthz, /readyz and /metrics."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.api_models.document import openapi_document
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.rest import CORE_KEY, PRINCIPAL, PUBLIC_METRICS_KEY, STARTED_AT_KEY
from services.gateway.tenancy.admin_api import require_admin


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
        if PRINCIPAL not in request or request[PRINCIPAL].may_use_model(model.name)  # a scoped key: its own
    ]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    name = request.match_info["model"]
    if name not in {model.name for model in core.served_models()}:
        raise GatewayError(ErrorKind.MODEL_NOT_FOUND, f"the model {name!r} does not exist", "model")
    if PRINCIPAL in request and not request[PRINCIPAL].may_use_model(name):
        raise GatewayError(ErrorKind.PERMISSION_DENIED, f"model: this key may not use the model {name!r}", "model")
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


async def metrics(request: web.Request) -> web.Response:
    """The admin key's (tenant names and their traffic are no client's business), unless public_metrics."""
    if not request.app.get(PUBLIC_METRICS_KEY, False):
        require_admin(request)
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})
