"""The OpenAPI 3.1 document of the gateway's own REST surface (served at /openapi.json). Request schemas name
the fields the gateway reads, with the types and bounds it checks; the response schemas are the shapes the
OpenAI and Anthropic SDKs parse. The property-based test posts generated bad input to every path listed here."""

from __future__ import annotations

import functools
from typing import Any

NUMBER = {"type": "number"}
INTEGER = {"type": "integer"}
STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
OBJECT = {"type": "object"}
STOP = {"anyOf": [STRING, {"type": "array", "items": STRING, "maxItems": 4}, {"type": "null"}]}
JSON_SCHEMA = {"type": "object", "description": "a JSON Schema (the subset structured output enforces)"}

TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                "description": STRING,
                "parameters": JSON_SCHEMA,
                "strict": BOOLEAN,
            },
        },
    },
}
TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"], "properties": {"name": STRING}},
            },
        },
    ]
}
TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": STRING}}
IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "description": "user messages only; a data: URL (PNG or JPEG), or http(s) where the server allows remote images",
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {"url": STRING, "detail": {"enum": ["auto", "low", "high"]}},
        },
    },
}
CONTENT_PARTS = {"anyOf": [STRING, {"type": "array", "items": {"anyOf": [TEXT_PART, IMAGE_PART]}}]}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [CONTENT_PARTS, {"type": "null"}]},
        "tool_call_id": STRING,
        "tool_calls": {"type": "array", "items": OBJECT},
    },
}
RESPONSE_FORMAT = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": STRING, "schema": JSON_SCHEMA, "strict": BOOLEAN},
        },
    },
}
SAMPLING = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 100},
    "top_p": {"type": "number", "maximum": 1},
    "seed": INTEGER,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "top_k": INTEGER,
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": NUMBER,
    "min_tokens": {"type": "integer", "minimum": 0},
    "ignore_eos": BOOLEAN,
    "cache_salt": STRING,
}

CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": STRING,
        "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": 8},
        "stop": STOP,
        "stream": BOOLEAN,
        "stream_options": {"type": "object", "properties": {"include_usage": BOOLEAN}},
        "logprobs": BOOLEAN,
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "tools": {"type": "array", "items": TOOL},
        "tool_choice": TOOL_CHOICE,
        "parallel_tool_calls": BOOLEAN,
        "response_format": RESPONSE_FORMAT,
        **SAMPLING,
    },
}
COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": STRING,
        "prompt": {"anyOf": [STRING, {"type": "array", "items": INTEGER, "minItems": 1}]},
        "max_tokens": {"type": "integer", "minimum": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": 8},
        "stop": STOP,
        "stream": BOOLEAN,
        "echo": BOOLEAN,
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        **SAMPLING,
    },
}
RESPONSES_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": STRING,
        "input": {"anyOf": [STRING, {"type": "array", "minItems": 1, "items": OBJECT}]},
        "instructions": STRING,
        "previous_response_id": STRING,
        "store": BOOLEAN,
        "stream": BOOLEAN,
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "function"},
                    "name": STRING,
                    "description": STRING,
                    "parameters": JSON_SCHEMA,
                },
            },
        },
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, OBJECT]},
        "parallel_tool_calls": BOOLEAN,
        "text": {"type": "object", "properties": {"format": OBJECT}},
        "temperature": SAMPLING["temperature"],
        "top_p": SAMPLING["top_p"],
        "metadata": OBJECT,
    },
}
MESSAGES_REQUEST = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": STRING,
        "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["user", "assistant"]},
                    "content": {"anyOf": [STRING, {"type": "array"}]},
                },
            },
        },
        "system": {"anyOf": [STRING, {"type": "array"}]},
        "stop_sequences": {"type": "array", "items": STRING, "maxItems": 4},
        "stream": BOOLEAN,
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": SAMPLING["top_p"],
        "top_k": INTEGER,
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": STRING, "description": STRING, "input_schema": JSON_SCHEMA},
            },
        },
        "tool_choice": {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]},
                "name": STRING,
                "disable_parallel_tool_use": BOOLEAN,
            },
        },
    },
}

OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": STRING,
                "type": STRING,
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"], "properties": {"type": STRING, "message": STRING}},
    },
}


def _errors(schema: dict[str, Any], statuses: tuple[str, ...]) -> dict[str, Any]:
    return {
        status: {"description": "an error", "content": {"application/json": {"schema": schema}}} for status in statuses
    }


def _post(
    summary: str, request: dict[str, Any], error: dict[str, Any] = OPENAI_ERROR, overloaded: str = "429"
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}, {"apiKey": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {
                    "description": "the result, or a text/event-stream when `stream` is true",
                    "content": {"application/json": {"schema": OBJECT}, "text/event-stream": {"schema": STRING}},
                },
                **_errors(error, ("400", "401", "404", "413", overloaded, "503", "504")),
            },
        }
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    get_models = {
        "get": {
            "summary": "the served models",
            "security": [{"bearer": []}, {"apiKey": []}],
            "responses": {
                "200": {"description": "a list of models", "content": {"application/json": {"schema": OBJECT}}},
                **_errors(OPENAI_ERROR, ("401",)),
            },
        }
    }
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": STRING}
    stored = {
        "parameters": [response_id],
        "get": {
            "summary": "a stored response",
            "security": [{"bearer": []}],
            "responses": {
                "200": {"description": "the response object", "content": {"application/json": {"schema": OBJECT}}},
                **_errors(OPENAI_ERROR, ("401", "404")),
            },
        },
        "delete": {
            "summary": "delete a stored response",
            "security": [{"bearer": []}],
            "responses": {
                "200": {"description": "deleted", "content": {"application/json": {"schema": OBJECT}}},
                **_errors(OPENAI_ERROR, ("401", "404")),
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvmesh gateway",
            "version": "1",
            "description": "OpenAI Chat Completions, Completions and Responses; Anthropic Messages.",
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            }
        },
        "paths": {
            "/v1/chat/completions": _post("OpenAI Chat Completions", CHAT_REQUEST),
            "/v1/completions": _post("OpenAI Completions (legacy)", COMPLETION_REQUEST),
            "/v1/responses": _post("OpenAI Responses", RESPONSES_REQUEST),
            "/v1/responses/{response_id}": stored,
            "/v1/messages": _post("Anthropic Messages", MESSAGES_REQUEST, ANTHROPIC_ERROR, overloaded="529"),
            "/v1/models": get_models,
            "/v1/mesh/workers": {
                "get": {
                    "summary": "each pool's workers with load, KV usage and cache size, and recommended pool sizes",
                    "security": [{"bearer": []}, {"apiKey": []}],
                    "responses": {
                        "200": {"description": "pools of workers", "content": {"application/json": {"schema": OBJECT}}},
                        **_errors(OPENAI_ERROR, ("401", "503")),
                    },
                }
            },
            "/healthz": {"get": {"summary": "liveness", "responses": {"200": {"description": "ok"}}}},
            "/readyz": {
                "get": {
                    "summary": "readiness",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
                }
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "metrics"}}}},
        },
    }
