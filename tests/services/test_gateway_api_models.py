"""The request models as the one definition of each API's fields: strict JSON types, null read as absent, the
client's field named in errors, the sampling fields mapped to the wire and the engine by name, and the OpenAPI
document generated from the same models."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine_core.sampling_params import SamplingParams
from mesh.compute.convert import sampling_from_proto, sampling_to_proto
from mesh.pb import common_pb2
from services.gateway.api_models.anthropic import MessagesRequest
from services.gateway.api_models.base import MAX_MESSAGES, param_of, validated
from services.gateway.api_models.document import openapi_document
from services.gateway.api_models.openai import TOOL_CHOICE_SHAPE, ChatCompletionRequest, CompletionRequest
from services.gateway.api_models.responses import ResponsesRequest
from services.gateway.api_models.sampling import SamplingFields, to_wire
from services.gateway.errors import GatewayError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def error_of(model: type[Any], body: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(GatewayError) as caught:
        validated(model, body)
    assert caught.value.http_status == 400
    return caught.value.param, caught.value.message


def test_every_wire_sampling_field_is_the_engines() -> None:
    """What lets sampling_to_proto / sampling_from_proto go by field name."""
    engine = {field.name for field in dataclasses.fields(SamplingParams)}
    assert {field.name for field in common_pb2.SamplingParams.DESCRIPTOR.fields} <= engine


def test_the_sampling_fields_reach_the_engine_by_name() -> None:
    values = {
        "temperature": 0.5,
        "top_p": 0.75,
        "top_k": 7,
        "seed": -3,
        "min_p": 0.125,
        "presence_penalty": 0.5,
        "frequency_penalty": -1.5,
        "repetition_penalty": 1.25,
        "min_tokens": 2,
        "ignore_eos": True,
    }
    assert set(values) == set(SamplingFields.model_fields)  # a new field needs a value here, nothing more
    request = validated(ChatCompletionRequest, {**CHAT, **values})
    params = sampling_from_proto(to_wire(request, 9, "max_tokens"))
    assert {name: getattr(params, name) for name in values} == values  # each value exact in float32
    assert params.max_tokens == 9


def test_the_apis_take_their_own_sampling_fields() -> None:
    extensions = {"min_p": 0.5, "seed": 4}
    messages = validated(MessagesRequest, {**CHAT, "max_tokens": 3, **extensions})
    assert to_wire(messages, 3, "max_tokens") == common_pb2.SamplingParams(
        temperature=1, top_p=1, max_tokens=3, repetition_penalty=1
    )
    responses = validated(ResponsesRequest, {"model": "m", "input": "Hi", **extensions})
    assert to_wire(responses, None, "max_output_tokens") == common_pb2.SamplingParams(
        temperature=1, top_p=1, seed=4, repetition_penalty=1
    )


def test_engine_rules_name_the_clients_field() -> None:
    request = validated(ChatCompletionRequest, {**CHAT, "min_tokens": 5})
    with pytest.raises(GatewayError) as caught:
        to_wire(request, 2, "max_completion_tokens")
    assert (caught.value.param, caught.value.message) == ("min_tokens", "min_tokens: 5 exceeds max_tokens 2")


def test_the_generic_conversion_round_trips() -> None:
    params = SamplingParams(
        temperature=0.5, top_k=3, seed=2**63 - 1, max_tokens=None, stop_token_ids=[4, 5], logprobs=2
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params
    # proto3's zeros: top_p and repetition_penalty 0 are off (1), an unset optional field is None
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams(temperature=0.0, max_tokens=None)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"max_tokens": 1.0}, "max_tokens", "'max_tokens' must be an integer"),
        ({"max_tokens": True}, "max_tokens", "'max_tokens' must be an integer"),
        ({"max_tokens": 2**31}, "max_tokens", "max_tokens: must be at most 2147483647, got 2147483648"),
        ({"top_p": 0}, "top_p", "top_p: must be greater than 0.0, got 0"),
        ({"model": ""}, "model", "'model' must not be empty"),
        ({"temperature": 1e999}, "temperature", "'temperature' must be a finite number"),
        ({"logit_bias": {"5": 1}}, "logit_bias", "'logit_bias' is not supported by this server"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}]},
            "messages[0].content[1]",
            '\'messages[0].content[1]\' must be a text or image_url part: {"type": "text", "text": ...}',
        ),
        (
            {"tool_choice": {"type": "function"}},
            "tool_choice",
            "'tool_choice' " + TOOL_CHOICE_SHAPE,
        ),
    ],
)
def test_chat_errors_name_the_field(body: dict[str, Any], param: str, message: str) -> None:
    assert error_of(ChatCompletionRequest, {**CHAT, **body}) == (param, message)


def test_null_is_absent_and_unknown_fields_are_ignored() -> None:
    request = validated(ChatCompletionRequest, {**CHAT, "temperature": None, "stop": None, "user": "u", "x": [1]})
    assert (request.temperature, request.stop, request.n) == (1.0, None, 1)
    assert validated(CompletionRequest, {"model": "m", "prompt": "p", "max_tokens": None}).max_tokens == 16
    assert validated(MessagesRequest, {**CHAT, "max_tokens": 2, "top_p": None}).top_p == 1.0


def test_other_apis_errors() -> None:
    assert error_of(ResponsesRequest, {"model": "m", "input": "x", "previous_response_id": ""})[0] == (
        "previous_response_id"
    )
    assert error_of(ResponsesRequest, {"model": "m", "input": []}) == ("input", "'input' must not be empty")
    assert error_of(MessagesRequest, {**CHAT}) == ("max_tokens", "'max_tokens' is required")
    assert error_of(CompletionRequest, {"model": "m", "prompt": [1, "a"]}) == (
        "prompt",
        "'prompt' must be a string or an array of token ids (one prompt per request)",
    )
    assert validated(CompletionRequest, {"model": "m", "prompt": [[1, 2]]}).prompt_value == [1, 2]


def test_union_member_tags_are_not_fields() -> None:
    assert param_of(("messages", 1, "content", "Parts", 0, "TextPart", "text")) == "messages[1].content[0].text"
    assert param_of(("stop", "str")) == "stop"
    assert param_of(()) is None


def schema_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(doc["components"]["schemas"][name])


def test_the_document_says_what_the_server_checks() -> None:
    """The disagreements schemathesis found, each now in the document (OpenAPI 3.0: an integer is written
    without a fraction there, as the server reads it)."""
    doc = openapi_document()
    assert doc["openapi"] == "3.0.3"
    chat, responses = schema_of(doc, "ChatCompletionRequest"), schema_of(doc, "ResponsesRequest")
    messages = schema_of(doc, "MessagesRequest")
    assert chat["properties"]["model"] == {"type": "string", "minLength": 1}
    top_p = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "nullable": True}
    assert chat["properties"]["top_p"] == top_p
    assert messages["properties"]["top_p"] == top_p  # the server reads null as unset
    assert messages["properties"]["max_tokens"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 2**31 - 1,
        "description": "unset: until the context is full",
    }
    previous = responses["properties"]["previous_response_id"]
    assert previous == {"type": "string", "pattern": "^resp_[A-Za-z0-9]{1,64}$", "nullable": True}
    assert "logit_bias" not in chat["properties"]  # refused by name: nothing to send
    assert set(messages["required"]) == {"model", "max_tokens", "messages"}
    tool = schema_of(doc, "ToolMessage")  # a tool message needs the id of the call it answers
    assert (set(tool["required"]), tool["properties"]["tool_call_id"]) == (
        {"role", "content", "tool_call_id"},
        {"type": "string", "minLength": 1},
    )
    assert not [name for name in doc["components"]["schemas"] if name.startswith("Unknown")]


def test_too_many_messages_are_refused_by_their_count() -> None:
    """Counted before any message is read: 20,000 used to hold the event loop for 1-2 s while each validated."""
    turn = {"role": "user", "content": "hi"}
    over = [turn] * (MAX_MESSAGES + 1)
    refused = f"'messages' takes at most {MAX_MESSAGES} items, got {MAX_MESSAGES + 1}"
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": over}) == ("messages", refused)
    assert error_of(MessagesRequest, {"model": "m", "max_tokens": 8, "messages": over}) == ("messages", refused)
    assert error_of(ResponsesRequest, {"model": "m", "input": over}) == (
        "input",
        f"'input' takes at most {MAX_MESSAGES} items, got {MAX_MESSAGES + 1}",
    )
    assert len(validated(ChatCompletionRequest, {"model": "m", "messages": [turn] * MAX_MESSAGES}).messages) == 2048
