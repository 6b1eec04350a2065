"""The gateway's own REST surface: /openapi.json describes it, and a property-based test (hypothesis) throws
generated bad input at every endpoint it lists: each answer is a 4xx (or a 200 for input that happens to be
valid), never a 5xx, never a hang. The workers are test doubles (scripted tokens): this is about the
gateway's parsing, checks and grammar building, not generation."""

from __future__ import annotations

import asyncio
import http.client
import json
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core import model_store
from kvmesh.nats_server import EmbeddedNats
from mesh.bus import Bus
from mesh.discovery import Announcer
from mesh.pb import common_pb2
from services.gateway.catalog import ModelCatalog, ServedModel, load_model
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer

from .gateway_harness import MODEL, Fakes, Script

KEY = "sk-fuzz-91ab"
TIMEOUT_S = 20.0  # per request: anything slower is a hang


class Gateway:
    """The gateway and its fake workers on their own event loop, in a thread: hypothesis drives it from plain
    synchronous tests over real HTTP."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.fakes = Fakes()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._stop: asyncio.Event | None = None
        self._done: Future[None] = Future()

    def start(self) -> None:
        self._thread.start()
        ready: Future[None] = Future()
        asyncio.run_coroutine_threadsafe(self._serve(ready), self.loop)
        ready.result(timeout=60)

    async def _serve(self, ready: Future[None]) -> None:
        try:
            model = load_model(str(model_store.ensure(MODEL)))
            catalog = ModelCatalog([ServedModel(MODEL, model.tokenizer, model.context_len)])
            with EmbeddedNats() as nats, tempfile.TemporaryDirectory() as state_dir:
                fakes = self.fakes
                fakes.script = Script(token_ids=model.tokenizer.encode("Hello there", add_special_tokens=False))
                server = await fakes.serve()
                bus = await Bus.connect(nats.url, name="fuzz-workers")
                announcers = [
                    Announcer(bus, fakes.info(worker, role), common_pb2.WorkerLoad, 0.5)
                    for worker, role in (
                        ("balancer-0", common_pb2.ROLE_BALANCER),
                        ("prefill-a", common_pb2.ROLE_PREFILL),
                        ("decode-a", common_pb2.ROLE_DECODE),
                    )
                ]
                gateway = GatewayServer(
                    GatewaySettings(
                        nats_url=nats.url,
                        http_port=0,
                        grpc_port=0,
                        api_keys=(KEY,),
                        state_dir=state_dir,  # the tenancy database and server secret, not the home directory
                        models=(MODEL,),
                        heartbeat_interval_s=0.5,
                        log_level="error",
                    ),
                    catalog=catalog,
                )
                await gateway.start()
                for announcer in announcers:
                    await announcer.start()
                while not gateway.core.is_ready():  # type: ignore[union-attr]
                    await asyncio.sleep(0.05)
                self.port = gateway.http_port
                self._stop = asyncio.Event()
                ready.set_result(None)
                await self._stop.wait()
                for announcer in announcers:
                    await announcer.stop()
                await gateway.stop()
                await bus.close()
                await server.stop(grace=None)
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise
        finally:
            self._done.set_result(None)

    def stop(self) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._done.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        try:
            connection.request(
                method,
                path,
                body=body,
                headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})},
            )
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gateway = Gateway()
    gateway.start()
    yield gateway
    gateway.stop()


def document(gateway: Gateway) -> dict[str, Any]:
    status, raw = gateway.request("GET", "/openapi.json")
    assert status == 200
    return dict(json.loads(raw))


def resolved(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """The schema a $ref names (#/components/schemas/...), or the schema itself."""
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def request_schema(doc: dict[str, Any], path: str) -> dict[str, Any]:
    return resolved(doc, doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])


def test_openapi_document_lists_every_route(gateway: Gateway) -> None:
    doc = document(gateway)
    assert doc["openapi"].startswith("3.0")  # integers written without a fraction (api_models/document.py)
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/models",
        "/v1/responses/{response_id}",
    } <= set(doc["paths"])
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if method == "parameters":
                continue
            assert operation["responses"], f"{method} {path} documents no response"
    chat = request_schema(doc, "/v1/chat/completions")
    assert {"tools", "tool_choice", "response_format", "logprobs", "n", "stream_options"} <= set(chat["properties"])
    messages = [resolved(doc, message) for message in chat["properties"]["messages"]["items"]["oneOf"]]
    [user] = [message for message in messages if message["properties"]["role"]["enum"] == ["user"]]
    parts = user["properties"]["content"]["oneOf"][1]["items"]["oneOf"]  # a string, or an array of parts
    kinds = [resolved(doc, part)["properties"]["type"]["enum"] for part in parts]
    assert kinds == [["text", "input_text", "output_text"], ["image_url", "input_image"]]


# ---- generated bad input ----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
VALID = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 4},
    "/v1/messages": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
}
PATHS = sorted(VALID)


def field_names(gateway_doc: dict[str, Any], path: str) -> list[str]:
    return sorted(request_schema(gateway_doc, path)["properties"])


@st.composite
def mutated(draw: st.DrawFn, names: dict[str, list[str]]) -> tuple[str, Any]:
    """A valid body with one to three of its documented fields replaced by arbitrary JSON (or removed), or
    arbitrary JSON altogether."""
    path = draw(st.sampled_from(PATHS))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(JSON)
    body = dict(VALID[path])
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names[path]))
        if draw(st.booleans()):
            body[name] = draw(JSON)
        else:
            body.pop(name, None)
    if "max_tokens" not in body and "max_output_tokens" not in body:
        body["max_tokens"] = 4
    return path, body


def check(status: int, raw: bytes, what: str) -> None:
    assert status < 500, f"{what} -> {status}: {raw[:300]!r}"
    if status >= 400:
        json.loads(raw)  # an error body, in the API's shape


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_generated_bodies_never_get_a_5xx(gateway: Gateway, data: st.DataObject) -> None:
    doc = document(gateway)
    names = {path: field_names(doc, path) for path in PATHS}
    path, body = data.draw(mutated(names))
    status, raw = gateway.request("POST", path, json.dumps(body).encode())
    check(status, raw, f"POST {path} {json.dumps(body)[:300]}")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=JSON, path=st.sampled_from(["chat", "tools", "responses", "anthropic"]))
def test_generated_schemas_never_get_a_5xx(gateway: Gateway, schema: Any, path: str) -> None:
    if path == "chat":
        body: dict[str, Any] = {
            **VALID["/v1/chat/completions"],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        }
        route = "/v1/chat/completions"
    elif path == "tools":
        body = {
            **VALID["/v1/chat/completions"],
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
        }
        route = "/v1/chat/completions"
    elif path == "responses":
        body = {**VALID["/v1/responses"], "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}
        route = "/v1/responses"
    else:
        body = {
            **VALID["/v1/messages"],
            "tools": [{"name": "f", "input_schema": schema}],
            "tool_choice": {"type": "any"},
        }
        route = "/v1/messages"
    status, raw = gateway.request("POST", route, json.dumps(body).encode())
    check(status, raw, f"{route} {json.dumps(body)[:300]}")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"\xff\xfe",
        b"[" * 100000 + b"]" * 100000,
        b'{"model": "' + b"x" * 100 + b'"}',
        b"NaN",
        b'{"model": 1e999}',
    ],
)
@pytest.mark.parametrize("path", PATHS)
def test_broken_bytes_are_a_400(gateway: Gateway, path: str, raw: bytes) -> None:
    status, body = gateway.request("POST", path, raw)
    assert 400 <= status < 500, (status, body[:200])


HOSTILE_SCHEMAS = [
    {"type": "string", "pattern": "(a+)+$"},
    {"type": "string", "pattern": "(" * 600 + ")" * 600},
    {"type": "array", "items": {"type": "string", "maxLength": 4096}, "maxItems": 4096},
    {"enum": list(range(1024))},
    {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,50}"} for i in range(300)}},
    {"$ref": "#"},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"type": "integer", "multipleOf": 997, "minimum": -(10**30), "maximum": 10**30},
]


@pytest.mark.parametrize("schema", HOSTILE_SCHEMAS)
def test_hostile_schemas_are_refused_or_served_in_time(gateway: Gateway, schema: dict[str, Any]) -> None:
    body = {
        **VALID["/v1/chat/completions"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    status, raw = gateway.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    check(status, raw, json.dumps(schema)[:200])


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_missing"),
        ("DELETE", "/v1/responses/resp_missing"),
        ("GET", "/v1/responses/%00"),
        ("GET", "/v1/models/none"),
        ("PUT", "/v1/chat/completions"),
        ("GET", "/v1/nothing"),
        ("POST", "/v1/models"),
    ],
)
def test_other_routes_and_methods(gateway: Gateway, method: str, path: str) -> None:
    status, raw = gateway.request(method, path)
    check(status, raw, f"{method} {path}")
    assert status >= 400


def test_anthropic_errors_in_its_shape_with_x_api_key(gateway: Gateway) -> None:
    status, raw = gateway.request("POST", "/v1/messages", b"{}", headers={"Authorization": "", "x-api-key": KEY})
    assert status == 400
    assert json.loads(raw)["type"] == "error" and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, raw = gateway.request("POST", "/v1/messages", b"{}", headers={"Authorization": "", "x-api-key": "no"})
    assert (status, json.loads(raw)["error"]["type"]) == (401, "authentication_error")


def test_a_saturated_mesh_is_429_for_openai_and_529_overloaded_for_anthropic(gateway: Gateway) -> None:
    import grpc

    saturated = [(grpc.StatusCode.RESOURCE_EXHAUSTED, None)] * 3  # every attempt (max_retries 2) finds no room
    gateway.fakes.script.prefill_failures = list(saturated)
    status, raw = gateway.request("POST", "/v1/messages", json.dumps(VALID["/v1/messages"]).encode())
    assert (status, json.loads(raw)["error"]["type"]) == (529, "overloaded_error")
    gateway.fakes.script.prefill_failures = list(saturated)
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=TIMEOUT_S)
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(VALID["/v1/chat/completions"]),
        headers={"Authorization": f"Bearer {KEY}"},
    )
    response = connection.getresponse()
    assert response.status == 429 and response.getheader("retry-after") == "1"
    assert json.loads(response.read())["error"]["code"] == "rate_limit_exceeded"
    connection.close()
    gateway.fakes.script.prefill_failures = []


def test_many_large_tools_are_refused_or_served_in_time(gateway: Gateway) -> None:
    properties = {f"p{i}": {"type": "string", "enum": [f"v{j}" for j in range(20)]} for i in range(30)}
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {"type": "object", "properties": properties, "required": list(properties)},
            },
        }
        for i in range(128)
    ]
    body = {**VALID["/v1/chat/completions"], "tools": tools, "tool_choice": "required"}
    status, raw = gateway.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    check(status, raw, "128 large tools")


def test_a_failure_mid_stream_raises_in_every_sdk(gateway: Gateway) -> None:
    import anthropic
    import openai

    # prefill's token is out, then every decode stream fails: the first attempt's and both migrations' (each
    # migration's prefill sends one more token, so the completion must be longer than three tokens)
    gateway.fakes.script.decode_error_after = 0
    saved = gateway.fakes.script.token_ids
    gateway.fakes.script.token_ids = saved * 4
    base_url = f"http://127.0.0.1:{gateway.port}"
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
        with pytest.raises(openai.APIError, match="retry shortly"):
            list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True))
        with pytest.raises(openai.APIError, match="retry shortly"):
            list(client.responses.create(model=MODEL, input="Hi", stream=True))
        messages = anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=TIMEOUT_S).messages
        with pytest.raises(anthropic.APIError, match="retry shortly"):
            list(messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}], stream=True))
    finally:
        gateway.fakes.script.decode_error_after = None
        gateway.fakes.script.token_ids = saved
