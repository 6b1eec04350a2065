"""The Responses API (openai SDK) and Anthropic Messages (anthropic SDK) against a real in-process mesh serving
SmolLM2: event sequences, function calls and their outputs, stored responses in NATS JetStream KV, tool_use,
errors in each API's shape, and the gateway's gRPC API with tools."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import grpc.aio
import jsonschema
import openai
import pytest

from mesh.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.response_store import BUCKET

from .api_harness import KEY, SMOL, ApiMesh

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMS,
}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_PARAMS}
ASK = "What is the weather in Paris?"


@pytest.fixture
def mesh(api_mesh_session: ApiMesh) -> ApiMesh:
    return api_mesh_session


# ---- Responses --------------------------------------------------------------------------------------------


async def test_response_with_instructions_is_stored_and_continued(mesh: ApiMesh) -> None:
    client = mesh.openai()
    first = await client.responses.create(
        model=SMOL, input="Name a fruit.", instructions="Answer in one word.", max_output_tokens=8, temperature=0
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage is not None and first.usage.output_tokens <= 8
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    follow = await client.responses.create(
        model=SMOL, input="And a vegetable?", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    assert follow.previous_response_id == first.id
    assert follow.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens  # the stored conversation came back
    # the record sits in JetStream KV, where any gateway replica reads it
    import nats

    client_nats = await nats.connect(mesh.nats_url)
    try:
        entry = await (await client_nats.jetstream().key_value(BUCKET)).get(follow.id)
        record = json.loads(entry.value or b"{}")
        assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    finally:
        await client_nats.close()


async def test_store_false_keeps_nothing(mesh: ApiMesh) -> None:
    client = mesh.openai()
    response = await client.responses.create(model=SMOL, input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model=SMOL, input="Hi", previous_response_id=response.id, max_output_tokens=3)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_response_stream_event_sequence(mesh: ApiMesh) -> None:
    stream = await mesh.openai().responses.create(
        model=SMOL, input="Say hello.", max_output_tokens=6, temperature=0, stream=True
    )
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert (
        kinds[-4:]
        == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        or kinds[-1] == "response.completed"
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text  # type: ignore[union-attr]


async def test_function_call_and_its_output(mesh: ApiMesh) -> None:
    client = mesh.openai()
    request: dict[str, Any] = dict(
        model=SMOL,
        input=ASK,
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        temperature=0,
        max_output_tokens=40,
        parallel_tool_calls=False,
    )
    whole = await client.responses.create(**request)
    [call] = [item for item in whole.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    stream = await client.responses.create(stream=True, **request)
    events = [event async for event in stream]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done[0].arguments == call.arguments  # type: ignore[union-attr]
    follow = await client.responses.create(
        model=SMOL,
        previous_response_id=whole.id,
        max_output_tokens=5,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}],
    )
    assert follow.status in ("completed", "incomplete")


# ---- Anthropic Messages --------------------------------------------------------------------------------------


async def test_message_text_and_stop_reasons(mesh: ApiMesh) -> None:
    client = mesh.anthropic()
    message = await client.messages.create(
        model=SMOL,
        max_tokens=5,
        system="Be brief.",
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Count to ten."}],
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    text = message.content[0].text  # type: ignore[union-attr]
    cut = await client.messages.create(
        model=SMOL,
        max_tokens=5,
        system="Be brief.",
        extra_body={"temperature": 0},
        stop_sequences=[text[2:4]],
        messages=[{"role": "user", "content": "Count to ten."}],
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", text[2:4])


async def test_message_stream_has_named_events_in_order(mesh: ApiMesh) -> None:
    client = mesh.anthropic()
    async with client.messages.stream(
        model=SMOL, max_tokens=6, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Say hello."}]
    ) as stream:
        events = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events[1] == "content_block_start" and "content_block_delta" in events
    assert events[-3:-1] == ["content_block_stop", "message_delta"]
    assert final.stop_reason == "max_tokens"
    # every frame has an `event:` line, and a ping is sent
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{mesh.base_url}/v1/messages",
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
            json={"model": SMOL, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
        ) as response,
    ):
        frames = (await response.text()).strip().split("\n\n")
    assert all(frame.startswith("event: ") for frame in frames)
    assert frames[1].startswith("event: ping")


async def test_tool_use_any_streams_its_input(mesh: ApiMesh) -> None:
    client = mesh.anthropic()
    request: dict[str, Any] = dict(
        model=SMOL,
        max_tokens=40,
        extra_body={"temperature": 0},
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": ASK}],
    )
    message = await client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    [tool_use] = [block for block in message.content if block.type == "tool_use"]
    jsonschema.validate(tool_use.input, WEATHER_PARAMS)  # type: ignore[union-attr]
    async with client.messages.stream(**request) as stream:
        partial = "".join(
            [
                e.delta.partial_json
                async for e in stream  # type: ignore[union-attr]
                if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
            ]
        )
    assert json.loads(partial) == tool_use.input  # type: ignore[union-attr]
    result = await client.messages.create(
        model=SMOL,
        max_tokens=5,
        extra_body={"temperature": 0},
        tools=[ANTHROPIC_TOOL],
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": tool_use.id,
                        "name": "get_weather",  # type: ignore[union-attr]
                        "input": tool_use.input,
                    }
                ],
            },  # type: ignore[union-attr]
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": tool_use.id,  # type: ignore[union-attr]
                        "content": "21 degrees",
                    }
                ],
            },
        ],
        tool_choice={"type": "none"},
    )
    assert result.content and result.content[0].type == "text"


async def test_anthropic_errors_have_its_shape(mesh: ApiMesh) -> None:
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        await mesh.anthropic(key="wrong").messages.create(
            model=SMOL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    assert unauthorized.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as not_found:
        await mesh.anthropic().messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert not_found.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",  # type: ignore[comparison-overlap]
            "message": "the model 'nope' does not exist",
        },
    }
    with pytest.raises(anthropic.BadRequestError):
        await mesh.anthropic().messages.create(model=SMOL, max_tokens=2, messages=[])


# ---- the gateway's gRPC API ----------------------------------------------------------------------------------


async def test_grpc_generate_with_tools_and_a_schema(mesh: ApiMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        metadata = (("authorization", f"Bearer {KEY}"),)
        request = gateway_pb2.GenerateRequest(
            model=SMOL,
            messages=[gateway_pb2.ChatMessage(role="user", content=ASK)],
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=40),
            tools=[gateway_pb2.Tool(name="get_weather", parameters_json=json.dumps(WEATHER_PARAMS))],
            tool_choice="required",
            parallel_tool_calls=False,
        )
        replies = [reply async for reply in stub.Generate(request, metadata=metadata)]
        arguments = "".join(d.arguments for r in replies for d in r.tool_calls)
        assert [d.name for r in replies for d in r.tool_calls if d.name] == ["get_weather"]
        jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)
        assert replies[-1].finish == "tool_calls"
        person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
        request = gateway_pb2.GenerateRequest(
            model=SMOL,
            messages=[gateway_pb2.ChatMessage(role="user", content="A person as JSON")],
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=40),
            response_format=gateway_pb2.ResponseFormat(json_schema=json.dumps(person)),
        )
        text = "".join([reply.text async for reply in stub.Generate(request, metadata=metadata)])
        jsonschema.validate(json.loads(text), person)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(
                gateway_pb2.GenerateRequest(
                    model=SMOL,
                    messages=[gateway_pb2.ChatMessage(role="user", content="x")],
                    response_format=gateway_pb2.ResponseFormat(json_schema='{"not": {}}'),
                ),
                metadata=metadata,
            ).read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'not'" in (caught.value.details() or "")
