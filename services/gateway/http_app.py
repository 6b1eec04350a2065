"""The REST app (aiohttp): one route table over the API modules, the plumbing they share (rest.py) and the
plain routes. listener.py serves it.

    chat_completions.py  /v1/chat/completions
    completions.py       /v1/completions (legacy)
    responses_api.py     /v1/responses (stored responses in NATS JetStream KV: response_store.py)
    messages_api.py      /v1/messages (Anthropic)
    mesh_workers.py      /v1/mesh/workers (the admin key)
    tenancy/admin_api.py /admin/v1/: tenants, keys, prices
    rollout_api.py       /admin/v1/rollouts: canary rollouts
    plain_routes.py      /v1/models, /openapi.json, /healthz, /readyz, /metrics (the admin key, unless
                         public_metrics; server.py may serve it with no key on a second port)
"""

from __future__ import annotations

import time

from aiohttp import web

from services.gateway import (
    chat_completions,
    completions,
    mesh_workers,
    messages_api,
    plain_routes,
    responses_api,
    rollout_api,
)
from services.gateway.core import GatewayCore
from services.gateway.response_store import ResponseStore
from services.gateway.rest import (
    CORE_KEY,
    MAX_BODY_BYTES,
    PUBLIC_METRICS_KEY,
    STARTED_AT_KEY,
    STORE_KEY,
    api_middleware,
)
from services.gateway.tenancy import admin_api


def create_app(
    core: GatewayCore,
    store: ResponseStore | None = None,
    admin: admin_api.Admin | None = None,
    *,
    public_metrics: bool = False,
) -> web.Application:
    app = web.Application(middlewares=[api_middleware], client_max_size=MAX_BODY_BYTES)
    app[PUBLIC_METRICS_KEY] = public_metrics
    app[CORE_KEY] = core
    app[STORE_KEY] = store or ResponseStore(None)
    app[STARTED_AT_KEY] = time.time()
    app[admin_api.ADMIN_KEY] = admin or admin_api.Admin()  # no admin key: the admin routes are off
    app.router.add_post(chat_completions.CHAT_PATH, chat_completions.create_chat_completion)
    app.router.add_post(completions.COMPLETIONS_PATH, completions.create_completion)
    app.router.add_post(responses_api.RESPONSES_PATH, responses_api.create_response)
    app.router.add_get(responses_api.RESPONSES_PATH + "/{response_id}", responses_api.get_response)
    app.router.add_delete(responses_api.RESPONSES_PATH + "/{response_id}", responses_api.delete_response)
    app.router.add_post(messages_api.MESSAGES_PATH, messages_api.create_message)
    app.router.add_get("/v1/models", plain_routes.list_models)
    app.router.add_get("/v1/models/{model}", plain_routes.get_model)
    app.router.add_get(mesh_workers.MESH_WORKERS_PATH, mesh_workers.list_mesh_workers)
    admin_api.add_routes(app)
    rollout_api.add_routes(app)
    app.router.add_get("/openapi.json", plain_routes.openapi_json)
    app.router.add_get("/healthz", plain_routes.healthz)
    app.router.add_get("/readyz", plain_routes.readyz)
    app.router.add_get("/metrics", plain_routes.metrics)
    return app
