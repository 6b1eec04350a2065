"""Requests the gateway refuses before routing: an unknown model, a missing or wrong key, bad fields; each gets
the OpenAI error body with the client's `param` and code, and no worker is asked.

Harness: the `mesh` and `script` fixtures of tests/services/gateway_harness.py (scripted workers).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from . import gateway_harness
from .gateway_harness import IDLE_MODEL, MODEL, Mesh, Script, post

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, script = gateway_harness.mesh, gateway_harness.script  # fixtures: each test file starts its own gateway


async def test_sdk_unknown_model(mesh: Mesh, script: Script) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await mesh.client().chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert script.routes == []


async def test_sdk_bad_key(mesh: Mesh, script: Script) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await mesh.client(key="sk-wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.code == "invalid_api_key"
    assert "sk-wrong" not in str(caught.value.body)
    models = await mesh.client(key="sk-other").models.list()  # every configured key works
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"},
            400,
            "temperature",
            None,
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 9}, 400, "n", None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, 400, "max_tokens", None),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16384},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**6},
            400,
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "word " * 17000}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages[0].role", None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stop": ["a"] * 5}, 400, "stop", None),
        ({"model": "gpt-17", "messages": [{"role": "user", "content": "Hi"}]}, 404, "model", "model_not_found"),
        ({"model": IDLE_MODEL, "messages": [{"role": "user", "content": "Hi"}]}, 503, None, "service_unavailable"),
        (b"{not json", 400, None, None),
        (b"[1, 2]", 400, None, None),
    ],
)
async def test_bad_requests(
    mesh: Mesh, script: Script, body: Any, status: int, param: str | None, code: str | None
) -> None:
    got_status, headers, raw = await post(mesh, body)
    error = json.loads(raw)["error"]
    assert (got_status, error["param"], error["code"]) == (status, param, code)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert headers["x-request-id"]
    assert script.routes == []


async def test_missing_key(mesh: Mesh, script: Script) -> None:
    status, _, raw = await post(mesh, {"model": MODEL, "messages": []}, key=None)
    assert status == 401
    assert json.loads(raw) == {
        "error": {
            "message": "Missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key'.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
