"""Chat Completions and Completions through the official `openai` SDK against a real in-process mesh (real
engines): tools under grammars, streamed tool calls equal to whole ones, response_format, logprobs, n, stop,
seeds, usage chunks and errors."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from .api_harness import DEEPSEEK, KEY, MODELS, SMOL, ApiMesh

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}  # no parameters
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in celsius."}]


@pytest.fixture
def mesh(api_mesh_session: ApiMesh) -> ApiMesh:
    return api_mesh_session


def schema_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters", {"type": "object", "properties": {}})


async def streamed(client: openai.AsyncOpenAI, **request: Any) -> list[Any]:
    stream = await client.chat.completions.create(stream=True, **request)
    return [chunk async for chunk in stream]


def joined_tool_calls(chunks: list[Any]) -> dict[int, dict[str, str]]:
    """index -> {id, name, arguments} from streamed deltas; checks an id and name come once, on the first delta."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.function.name, "the first delta of a call names it"
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments or ""
    return calls


@pytest.mark.parametrize("model", [SMOL, DEEPSEEK])
async def test_required_tool_call_streams_exactly_what_it_returns(mesh: ApiMesh, model: str) -> None:
    client = mesh.openai()
    # deepseek-tiny's random weights would call tools until max_tokens: one call each for it
    request: dict[str, Any] = dict(
        model=model,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        seed=7,
        parallel_tool_calls=model == SMOL,
    )
    whole = await client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = WEATHER if call.function.name == "get_weather" else CLOCK
        jsonschema.validate(json.loads(call.function.arguments), schema_of(tool))  # always valid: the grammar
        if tool is CLOCK:
            assert call.function.arguments == "{}"
    chunks = await streamed(client, **request)
    calls = joined_tool_calls(chunks)
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"


@pytest.mark.parametrize("model", [SMOL, DEEPSEEK])
async def test_named_tool_is_the_one_called(mesh: ApiMesh, model: str) -> None:
    whole = await mesh.openai().chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        temperature=0,
        max_tokens=60,
        parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [call] = whole.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_time", "{}")
    assert call.id.startswith("call_") and whole.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("model", [SMOL, DEEPSEEK])
async def test_json_schema_output_validates(mesh: ApiMesh, model: str) -> None:
    whole = await mesh.openai().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        temperature=0.7,
        seed=3,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content or ""), PERSON)


async def test_json_object_output_parses(mesh: ApiMesh) -> None:
    whole = await mesh.openai().chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "A JSON object about cats."}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(whole.choices[0].message.content or ""), dict)
    else:  # cut off by max_tokens: still a valid JSON prefix of an object
        assert (whole.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not'"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "string", "pattern": "(?=a)a"}, "lookaround"),
        ({"$ref": "https://example.com/schema.json"}, "local '$ref'"),
    ],
)
async def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_it(
    mesh: ApiMesh, schema: dict[str, Any], feature: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await mesh.openai().chat.completions.create(
            model=SMOL,
            messages=ASK,
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    assert feature in caught.value.message
    assert caught.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]


async def test_logprobs_and_top_logprobs(mesh: ApiMesh) -> None:
    whole = await mesh.openai().chat.completions.create(
        model=SMOL,
        messages=ASK,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == whole.usage.completion_tokens == 6  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy: the chosen token is the most likely
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)


async def test_n_choices_with_a_seed_are_reproducible(mesh: ApiMesh) -> None:
    request: dict[str, Any] = dict(
        model=SMOL, messages=ASK, n=3, temperature=1.0, seed=11, max_tokens=8, extra_body={"ignore_eos": True}
    )
    first = await mesh.openai().chat.completions.create(**request)
    second = await mesh.openai().chat.completions.create(**request)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len({c.message.content for c in first.choices}) > 1  # each choice draws its own tokens
    assert first.usage is not None and first.usage.completion_tokens == 3 * 8  # the prompt counted once
    assert (
        first.usage.prompt_tokens
        == (await mesh.openai().chat.completions.create(model=SMOL, messages=ASK, max_tokens=1)).usage.prompt_tokens
    )  # type: ignore[union-attr]


async def test_stop_string_cuts_the_output_and_is_not_emitted(mesh: ApiMesh) -> None:
    client = mesh.openai()
    base: dict[str, Any] = dict(model=SMOL, messages=ASK, temperature=0, max_tokens=20, extra_body={"ignore_eos": True})
    full = (await client.chat.completions.create(**base)).choices[0].message.content or ""
    stop = full[8:11]
    cut = await client.chat.completions.create(stop=[stop, "\u2603"], **base)
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chunks = await streamed(client, stop=[stop], **base)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[: full.index(stop)]


async def test_include_usage_is_one_last_chunk_with_no_choices(mesh: ApiMesh) -> None:
    chunks = await streamed(
        mesh.openai(), model=SMOL, messages=ASK, temperature=0, max_tokens=5, stream_options={"include_usage": True}
    )
    assert all(chunk.usage is None for chunk in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5 and last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert chunks[-2].choices[0].finish_reason == "length"
    plain = await streamed(mesh.openai(), model=SMOL, messages=ASK, temperature=0, max_tokens=5)
    assert all(chunk.usage is None for chunk in plain) and all(chunk.choices for chunk in plain)


async def test_tool_results_go_back_through_the_template(mesh: ApiMesh) -> None:
    messages: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    for model in (SMOL, DEEPSEEK):
        whole = await mesh.openai().chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=5
        )
        assert whole.choices[0].message.tool_calls is None
        assert whole.usage.prompt_tokens > 40  # type: ignore[union-attr]


async def test_legacy_completions(mesh: ApiMesh) -> None:
    client = mesh.openai()
    whole = await client.completions.create(
        model=SMOL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2, echo=True
    )
    assert whole.choices[0].text.startswith("The capital of France is")
    assert len(whole.choices[0].logprobs.tokens) == 5  # type: ignore[union-attr]
    stream = await client.completions.create(
        model=SMOL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert "The capital of France is" + text == whole.choices[0].text


async def test_errors(mesh: ApiMesh) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        await mesh.openai().chat.completions.create(model="nope", messages=ASK)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        await mesh.openai(key="sk-wrong").chat.completions.create(model=SMOL, messages=ASK)
    with pytest.raises(openai.BadRequestError) as too_long:
        await mesh.openai().chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "hi " * 9000}])
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as bad_n:
        await mesh.openai().chat.completions.create(model=SMOL, messages=ASK, n=50)
    assert bad_n.value.param == "n"
    with pytest.raises(openai.BadRequestError) as bad_class:
        await mesh.openai().chat.completions.create(
            model=SMOL, messages=ASK, max_tokens=1, extra_headers={"x-kvmesh-traffic-class": "Agent Loop!"}
        )
    assert bad_class.value.param == "traffic_class" and "'Agent Loop!'" in bad_class.value.message
    models = await mesh.openai().models.list()
    assert sorted(m.id for m in models.data) == sorted(MODELS)


async def test_an_engine_failure_mid_stream_raises_in_the_sdk(mesh: ApiMesh) -> None:
    stream = await mesh.openai().chat.completions.create(
        model=SMOL, messages=ASK, max_tokens=200, stream=True, extra_body={"ignore_eos": True}, temperature=0
    )
    decoder = mesh.decode.decoder  # type: ignore[attr-defined]
    with pytest.raises(openai.APIError) as caught:
        async for _chunk in stream:
            for request_id in list(decoder._following):
                await decoder.abort(request_id)
    assert "retry" in caught.value.message
    assert KEY not in caught.value.message
