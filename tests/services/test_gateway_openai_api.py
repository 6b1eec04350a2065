"""Chat Completions bodies -> ChatRequest (each bad field names itself), the wire's SamplingParams, and the
exact shapes of completions, stream chunks and errors."""

from __future__ import annotations

import json
from typing import Any

import grpc
import grpc.aio
import pytest
from aiohttp.test_utils import TestClient, TestServer

from mesh.discovery import KnownWorker
from mesh.pb import common_pb2
from mesh.rpc import Channels
from mesh.service import Lifecycle
from services.gateway.auth import KeyRing
from services.gateway.catalog import ModelCatalog
from services.gateway.chat import ChoiceResult
from services.gateway.chat_completions import ChunkShape, completion_body, parse_chat_request
from services.gateway.core import GatewayCore
from services.gateway.errors import ErrorKind, GatewayError, from_rpc_error
from services.gateway.grpc_api import check_sampling
from services.gateway.http_app import create_app
from services.gateway.mesh_view import MeshView
from services.gateway.openai_shapes import SSE_DONE, sse
from services.gateway.pipeline import Pipeline, Usage

MESSAGES = [{"role": "user", "content": "Hi"}]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "deepseek-tiny", "messages": MESSAGES, **fields}


def test_minimal_request_takes_openai_defaults() -> None:
    chat = parse_chat_request(body())
    assert chat.turn.model == "deepseek-tiny"
    assert chat.turn.messages == [{"role": "user", "content": "Hi"}]
    assert (chat.stream, chat.include_usage, chat.turn.stop, chat.max_tokens, chat.turn.cache_salt) == (
        False,
        False,
        (),
        None,
        "",
    )
    # temperature and top_p are on the wire even when defaulted: an unset proto float would read as greedy
    assert chat.turn.sampling.temperature == 1.0 and chat.turn.sampling.top_p == 1.0
    assert not chat.turn.sampling.HasField("max_tokens") and not chat.turn.sampling.HasField("seed")


def test_sampling_fields_reach_the_wire() -> None:
    chat = parse_chat_request(
        body(
            temperature=0,
            top_p=0.5,
            max_tokens=7,
            seed=42,
            stop="END",
            presence_penalty=0.25,
            frequency_penalty=-0.5,
            user="u1",
            n=1,
        )
    )
    assert chat.turn.sampling == common_pb2.SamplingParams(
        temperature=0.0,
        top_p=0.5,
        max_tokens=7,
        seed=42,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.0,
    )
    assert chat.turn.stop == ("END",)
    assert (chat.max_tokens, chat.turn.max_tokens_param) == (7, "max_tokens")


def test_vllm_extensions_reach_the_wire() -> None:
    chat = parse_chat_request(
        body(top_k=-1, min_p=0.1, repetition_penalty=1.2, min_tokens=3, ignore_eos=True, max_tokens=9)
    )
    assert chat.turn.sampling == common_pb2.SamplingParams(
        temperature=1.0,
        top_p=1.0,
        max_tokens=9,
        top_k=0,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=3,
        ignore_eos=True,
    )


def test_max_completion_tokens_wins_and_is_named_in_errors() -> None:
    chat = parse_chat_request(body(max_tokens=100, max_completion_tokens=5))
    assert (chat.max_tokens, chat.turn.max_tokens_param, chat.turn.sampling.max_tokens) == (
        5,
        "max_completion_tokens",
        5,
    )
    with pytest.raises(GatewayError) as caught:
        parse_chat_request(body(max_completion_tokens=0))
    assert caught.value.param == "max_completion_tokens"
    assert caught.value.message == "max_completion_tokens: must be at least 1, got 0"


def test_messages_are_normalized() -> None:
    chat = parse_chat_request(
        body(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": "x",
                },
                {"role": "assistant", "content": None},
            ]
        )
    )
    assert chat.turn.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


def test_stream_options() -> None:
    chat = parse_chat_request(body(stream=True, stream_options={"include_usage": True}))
    assert (chat.stream, chat.include_usage) == (True, True)
    assert parse_chat_request(body(stream=True)).include_usage is False


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": 3}, "model"),
        ({"model": ""}, "model"),
        ({"messages": "Hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["Hi"]}, "messages[0]"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"seed": "7"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"n": 9}, "n"),
        ({"n": 0}, "n"),
        ({"n": "1"}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "maybe"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "contains": {}}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"cache_salt": 1}, "cache_salt"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_field_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as caught:
        parse_chat_request(body(**fields))
    error = caught.value
    assert (error.http_status, error.param) == (400, param)
    assert error.body()["error"]["type"] == "invalid_request_error"
    assert error.body()["error"]["code"] is None


def test_body_must_be_an_object() -> None:
    with pytest.raises(GatewayError) as caught:
        parse_chat_request(["not", "an", "object"])
    assert (caught.value.http_status, caught.value.param) == (400, None)


def test_accepted_no_op_fields() -> None:
    chat = parse_chat_request(body(response_format={"type": "text"}, logprobs=False, tools=[], stop=["", "x"]))
    assert chat.turn.stop == ("x",)


def test_grpc_sampling_checked_as_the_engine_reads_it() -> None:
    check_sampling(common_pb2.SamplingParams())  # all defaults: greedy, top_p 0 read as 1
    with pytest.raises(GatewayError) as caught:
        check_sampling(common_pb2.SamplingParams(max_tokens=0))
    assert caught.value.param == "max_tokens"
    with pytest.raises(GatewayError) as caught:
        check_sampling(common_pb2.SamplingParams(logprobs=50))
    assert caught.value.param == "logprobs"


USAGE = Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=8)
USAGE_BODY = {
    "prompt_tokens": 12,
    "completion_tokens": 5,
    "total_tokens": 17,
    "prompt_tokens_details": {"cached_tokens": 8},
}


def test_completion_body() -> None:
    result = ChoiceResult(0, text="Hello", finish_reason="length")
    assert completion_body("chatcmpl-r1", 1700000000, "deepseek-tiny", [result], USAGE) == {
        "id": "chatcmpl-r1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "deepseek-tiny",
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello", "refusal": None},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": USAGE_BODY,
    }


def test_chunks_with_include_usage() -> None:
    shape = ChunkShape("chatcmpl-r1", 1700000000, "m", include_usage=True)
    head = {
        "id": "chatcmpl-r1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "system_fingerprint": None,
    }
    assert shape.role() == {
        **head,
        "usage": None,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    assert shape.content("Hi") == {
        **head,
        "usage": None,
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}],
    }
    assert shape.finish("stop") == {
        **head,
        "usage": None,
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
    }
    assert shape.usage(USAGE) == {**head, "choices": [], "usage": USAGE_BODY}


def test_chunks_without_include_usage_have_no_usage_field() -> None:
    shape = ChunkShape("chatcmpl-r1", 1, "m", include_usage=False)
    for chunk in (shape.role(), shape.content("x"), shape.finish("length")):
        assert "usage" not in chunk
    with pytest.raises(AssertionError):
        shape.usage(USAGE)


def test_sse_framing() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "status", "error_code"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
        (grpc.StatusCode.NOT_FOUND, 503, "service_unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout"),
        (grpc.StatusCode.INTERNAL, 502, "upstream_error"),
    ],
)
def test_worker_status_mapping(code: grpc.StatusCode, status: int, error_code: str | None) -> None:
    error = from_rpc_error(rpc_error(code, "ipv4:10.0.0.7:5000 refused"), "prefill")
    assert error.http_status == status
    assert error.body()["error"]["code"] == error_code
    if status != 400:  # transport details name internal addresses: never shown to the client
        assert "10.0.0.7" not in error.message
    assert error.http_headers() == ({"retry-after": "1"} if status == 429 else {})


def test_error_kinds_map_to_grpc_codes() -> None:
    assert ErrorKind.INVALID_API_KEY.grpc_code == grpc.StatusCode.UNAUTHENTICATED
    assert ErrorKind.MODEL_NOT_FOUND.grpc_code == grpc.StatusCode.NOT_FOUND
    assert ErrorKind.RATE_LIMITED.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ErrorKind.CONTEXT_LENGTH.http_status == 400


def test_tools_tool_choice_and_response_format_are_parsed() -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    chat = parse_chat_request(body(tools=[weather], n=2, logprobs=True, top_logprobs=3, parallel_tool_calls=False))
    assert [t.name for t in chat.turn.tools] == ["get_weather"]
    assert (
        chat.turn.tool_choice.mode,
        chat.turn.parallel_tool_calls,
        chat.turn.n,
        chat.turn.logprobs,
        chat.turn.top_logprobs,
    ) == (
        "auto",
        False,
        2,
        True,
        3,
    )
    named = parse_chat_request(
        body(tools=[weather], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert (named.turn.tool_choice.mode, named.turn.tool_choice.name) == ("named", "get_weather")
    assert parse_chat_request(body()).turn.tool_choice.mode == "none"
    fmt = parse_chat_request(
        body(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
            }
        )
    ).turn.response_format
    assert (
        fmt is not None and fmt.kind == "json_schema" and json.loads(fmt.spec)["properties"]["a"]["type"] == "integer"
    )
    assert parse_chat_request(body(response_format={"type": "json_object"})).turn.response_format.kind == "json_object"  # type: ignore[union-attr]


def test_tool_messages_are_kept_for_the_template() -> None:
    chat = parse_chat_request(
        body(
            messages=[
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]
        )
    )
    assert chat.turn.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
    }
    assert chat.turn.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


class NoWorkers:
    def workers(self, role: int | None = None, model: str | None = None) -> list[KnownWorker]:
        return []

    def record_failure(self, worker_id: str) -> None:
        raise AssertionError(f"no worker is known, so none can fail: {worker_id}")


def bare_core(key: str) -> GatewayCore:
    """A gateway that knows no model and no worker: enough for what the app answers before any handler runs."""
    view = MeshView(NoWorkers())
    return GatewayCore(KeyRing([key]), ModelCatalog([]), view, Pipeline(Channels(None), view, 16, 0), Lifecycle(), 5.0)


OPENAI_405 = {
    "error": {
        "message": "Method Not Allowed",
        "type": "invalid_request_error",
        "param": None,
        "code": "method_not_allowed",
    }
}


@pytest.mark.parametrize(
    ("method", "path", "allow", "body"),
    [
        ("GET", "/v1/chat/completions", "POST", OPENAI_405),
        ("POST", "/v1/models", "GET, HEAD", OPENAI_405),
        ("PUT", "/v1/responses/resp_1", "DELETE, GET, HEAD", OPENAI_405),
        (  # Anthropic's error shape on /v1/messages
            "GET",
            "/v1/messages",
            "POST",
            {"type": "error", "error": {"type": "invalid_request_error", "message": "Method Not Allowed"}},
        ),
    ],
)
async def test_a_wrong_method_is_a_405_naming_the_allowed_ones(
    method: str, path: str, allow: str, body: dict[str, Any]
) -> None:
    async with TestClient(TestServer(create_app(bare_core("sk-405")))) as client:
        response = await client.request(method, path, headers={"Authorization": "Bearer sk-405", "x-request-id": "r1"})
        assert (response.status, response.headers["Allow"], response.headers["x-request-id"]) == (405, allow, "r1")
        assert await response.json() == body
