"""The OpenAPI 3.0 document of the gateway's REST surface (served at /openapi.json), generated from the request
models that parse the bodies, so the two cannot disagree. The error bodies are models too; the success bodies
are the shapes the OpenAI and Anthropic SDKs parse (objects, or an event stream when `stream` is true)."""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.gateway.api_models.admin import (
    ADMIN_MODELS,
    KeyCreate,
    PricesUpdate,
    RolloutCreate,
    TenantCreate,
    TenantUpdate,
)
from services.gateway.api_models.anthropic import MessagesRequest
from services.gateway.api_models.openai import ChatCompletionRequest, CompletionRequest
from services.gateway.api_models.responses import RESPONSE_ID, ResponsesRequest

OBJECT = {"type": "object"}
STRING = {"type": "string"}


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None  # the client's field it is about: messages[1].content, max_tokens
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str  # starts with the field it is about


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    MessagesRequest,
    OpenAIError,
    AnthropicError,
    *ADMIN_MODELS,
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _tidy(node: Any) -> Any:
    """pydantic's JSON Schema as the document says it: no titles, no defaults (the descriptions say what unset
    means), and a field that is not required also takes null (RequestModel reads null as absent)."""
    if isinstance(node, list):
        return [_tidy(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _tidy(value) for key, value in node.items() if key not in ("title", "default")}
    properties = node.get("properties")
    if node.get("type") == "object" and isinstance(properties, dict):
        required = set(node.get("required", ()))
        node["properties"] = {
            name: schema if name in required or _takes_null(schema) else _nullable(schema)
            for name, schema in properties.items()
        }
    return node


def _takes_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or any(member.get("type") == "null" for member in schema.get("anyOf", ()))


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    described: dict[str, Any] = {key: schema[key] for key in ("description",) if key in schema}
    inner = {key: value for key, value in schema.items() if key not in described}
    return {"anyOf": [inner, {"type": "null"}], **described}


def _openapi_30(node: Any) -> Any:
    """JSON Schema 2020-12 (pydantic's) in OpenAPI 3.0's dialect: null as `nullable`, `const` as a one-value
    enum, exclusive bounds as flags. 3.0 because its integers are written without a fraction, as the server
    reads them (1.0 is refused where an integer belongs); in 2020-12, 1.0 is an integer."""
    if isinstance(node, list):
        return [_openapi_30(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _openapi_30(value) for key, value in node.items()}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node[bound], bool):
            node[flag], node[bound] = node[bound], True
    members = node.get("anyOf")
    if isinstance(members, list) and {"type": "null"} in members:
        rest = [member for member in members if member != {"type": "null"}]
        del node["anyOf"]
        if len(rest) == 1 and "$ref" not in rest[0]:
            node.update(rest[0])
        else:
            node["allOf" if len(rest) == 1 else "anyOf"] = rest
        node["nullable"] = True
    return node


@functools.cache
def schemas() -> dict[str, Any]:
    """components.schemas: every model, and the models they use."""
    _, top = models_json_schema(
        [(model, "validation") for model in MODELS], ref_template="#/components/schemas/{model}"
    )
    defined = _openapi_30(_tidy(top["$defs"]))
    used = _referenced(defined) | {model.__name__ for model in MODELS}
    return {name: schema for name, schema in defined.items() if name in used}  # not the undocumented members


def _referenced(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*map(_referenced, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    names = {node["$ref"].rsplit("/", 1)[1]} if isinstance(node.get("$ref"), str) else set()
    return names.union(*map(_referenced, node.values()))


def _errors(model: type[BaseModel], statuses: tuple[str, ...]) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref(model)}}
    return {status: {"description": "an error", "content": content} for status in statuses}


def _post(summary: str, request: type[BaseModel], error: type[BaseModel] = OpenAIError) -> dict[str, Any]:
    overloaded = "529" if error is AnthropicError else "429"
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}, {"apiKey": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {
                    "description": "the result, or a text/event-stream when `stream` is true",
                    "content": {"application/json": {"schema": OBJECT}, "text/event-stream": {"schema": STRING}},
                },
                **_errors(error, ("400", "401", "404", "413", overloaded, "503", "504")),
            },
        }
    }


def _get(summary: str, description: str, errors: tuple[str, ...], security: bool = True) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": description, "content": {"application/json": {"schema": OBJECT}}},
            **_errors(OpenAIError, errors),
        },
    }
    if security:
        operation["security"] = [{"bearer": []}, {"apiKey": []}]
    return {"get": operation}


def _admin(method: str, summary: str, body: type[BaseModel] | None = None, status: str = "200") -> dict[str, Any]:
    """An /admin/v1/ operation: the admin key as bearer; 403 for a tenant's key (or when no admin key is
    configured), 404 for an unknown id."""
    operation: dict[str, Any] = {
        "summary": summary,
        "security": [{"bearer": []}],
        "responses": {
            status: {"description": summary, "content": {"application/json": {"schema": OBJECT}}},
            **_errors(OpenAIError, ("400", "401", "403", "404", "409") if body else ("401", "403", "404")),
        },
    }
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    return {method: operation}


def _admin_paths() -> dict[str, Any]:
    tenant_id = [{"name": "tenant_id", "in": "path", "required": True, "schema": STRING}]
    key_id = [{"name": "key_id", "in": "path", "required": True, "schema": STRING}]
    tenant_query = [{"name": "tenant", "in": "query", "required": False, "schema": STRING}]
    rollout_id = [{"name": "rollout_id", "in": "path", "required": True, "schema": STRING}]
    return {
        "/admin/v1/tenants": {
            **_admin("post", "create a tenant", TenantCreate, "201"),
            **_admin("get", "every tenant"),
        },
        "/admin/v1/tenants/{tenant_id}": {
            "parameters": tenant_id,
            **_admin("get", "a tenant"),
            **_admin("patch", "change a tenant's name, limits, price plan or cache group", TenantUpdate),
        },
        "/admin/v1/keys": {
            **_admin("post", "create a key (the response is the only time the key is shown)", KeyCreate, "201"),
            "get": {**_admin("get", "the keys, of one tenant with ?tenant=")["get"], "parameters": tenant_query},
        },
        "/admin/v1/keys/{key_id}": {"parameters": key_id, **_admin("delete", "revoke a key")},
        "/admin/v1/prices": {
            **_admin("get", "the price table"),
            **_admin("put", "set prices per plan and model (dollars per million tokens)", PricesUpdate),
        },
        "/admin/v1/usage": _usage_path(),
        "/admin/v1/rollouts": {
            **_admin("post", "start a canary rollout of a model (409 while it has one running)", RolloutCreate, "201"),
            **_admin("get", "every rollout, oldest first"),
        },
        "/admin/v1/rollouts/{rollout_id}": {"parameters": rollout_id, **_admin("get", "a rollout and its decisions")},
        "/admin/v1/rollouts/{rollout_id}/abort": {
            "parameters": rollout_id,
            "post": {
                **_admin("post", "abort a running rollout: weight 0, the canary drained")["post"],
                "responses": _admin("post", "the aborted rollout", RolloutCreate)["post"]["responses"],
            },
        },
    }


def _usage_path() -> dict[str, Any]:
    """The ledger's report (tenancy/usage.py): JSON, or with format=csv the totals as CSV."""
    operation = _admin("get", "a tenant's usage: totals by day (UTC) and model, and its records")["get"]
    operation["responses"] |= _errors(OpenAIError, ("400",))
    operation["responses"]["200"]["content"]["text/csv"] = {"schema": STRING}
    day = {"type": "string", "format": "date"}
    limit = {"type": "integer", "minimum": 0, "maximum": 100_000}
    operation["parameters"] = [
        {"name": "tenant", "in": "query", "required": True, "schema": STRING},
        {"name": "since", "in": "query", "required": True, "schema": day},
        {"name": "until", "in": "query", "required": False, "schema": day},
        {"name": "format", "in": "query", "required": False, "schema": {"type": "string", "enum": ["json", "csv"]}},
        {"name": "limit", "in": "query", "required": False, "schema": limit},
    ]
    return {"get": operation}


def _stored_response() -> dict[str, Any]:
    response_id = {
        "name": "response_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": f"^{RESPONSE_ID.pattern}$"},
    }
    responses = {
        "200": {"description": "the response object", "content": {"application/json": {"schema": OBJECT}}},
        **_errors(OpenAIError, ("401", "404")),
    }
    return {
        "parameters": [response_id],
        "get": {"summary": "a stored response", "security": [{"bearer": []}], "responses": responses},
        "delete": {"summary": "delete a stored response", "security": [{"bearer": []}], "responses": responses},
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "kvmesh gateway",
            "version": "1",
            "description": "OpenAI Chat Completions, Completions and Responses; Anthropic Messages.",
        },
        "components": {
            "schemas": schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "paths": {
            "/v1/chat/completions": _post("OpenAI Chat Completions", ChatCompletionRequest),
            "/v1/completions": _post("OpenAI Completions (legacy)", CompletionRequest),
            "/v1/responses": _post("OpenAI Responses", ResponsesRequest),
            "/v1/responses/{response_id}": _stored_response(),
            "/v1/messages": _post("Anthropic Messages", MessagesRequest, AnthropicError),
            "/v1/models": _get("the served models", "a list of models", ("401",)),
            "/v1/mesh/workers": _get(
                "each pool's workers with load, KV usage and cache size, and recommended pool sizes (admin key)",
                "pools of workers",
                ("401", "403", "503"),
            ),
            "/healthz": {"get": {"summary": "liveness", "responses": {"200": {"description": "ok"}}}},
            "/readyz": {
                "get": {
                    "summary": "readiness",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (admin key; keyless on KVMESH_METRICS_PORT)",
                    "responses": {"200": {"description": "metrics"}, **_errors(OpenAIError, ("401", "403"))},
                    "security": [{"bearer": []}, {"apiKey": []}],
                }
            },
            **_admin_paths(),
        },
    }
