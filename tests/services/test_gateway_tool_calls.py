"""Tool-call formats and their parser, and which JSON Schemas the grammar may enforce (no mesh, no engine)."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from mesh.pb import common_pb2
from services.gateway.chat import ChatTurn, traffic_class_of
from services.gateway.errors import GatewayError
from services.gateway.schema_support import Unsupported, check_schema, json_schema_output
from services.gateway.tool_calls import (
    DEEPSEEK,
    HERMES,
    ParsedArgs,
    ParsedCallEnd,
    ParsedCallStart,
    ParsedText,
    Tool,
    ToolCallParser,
    ToolChoice,
    ToolSyntax,
    parse_tool,
    syntax_for,
)

CALLS = [
    ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ("get_time", "{}"),
    ("nest", '{"a": {"b": [1, {"c": "}\\n</tool_call>"}]}}'),
]


def parse(syntax: ToolSyntax, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[list[str]]]:
    """(text, [(name, arguments)], argument deltas per call), feeding the pieces one by one."""
    parser = ToolCallParser(syntax)
    events = [event for piece in pieces for event in parser.push(piece)] + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, ParsedText))
    names = [e.name for e in events if isinstance(e, ParsedCallStart)]
    deltas: list[list[str]] = [[] for _ in names]
    for event in events:
        if isinstance(event, ParsedArgs):
            deltas[event.call_index].append(event.delta)
    ends = [e.arguments for e in events if isinstance(e, ParsedCallEnd)]
    assert ends == ["".join(d) for d in deltas][: len(ends)]  # the end repeats exactly what was streamed
    return text, list(zip(names, ["".join(d) for d in deltas], strict=True)), deltas


def random_split(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("syntax", [DEEPSEEK, HERMES])
def test_calls_parse_the_same_however_the_text_is_split(syntax: ToolSyntax) -> None:
    output = "Let me check." + syntax.calls_text(CALLS)
    whole = parse(syntax, [output])
    assert whole[0] == "Let me check." and whole[1] == CALLS
    for seed in range(30):
        assert parse(syntax, random_split(output, seed))[:2] == whole[:2]
    assert parse(syntax, list(output))[:2] == whole[:2]  # one character at a time


def test_text_that_only_looks_like_a_marker_is_text() -> None:
    assert parse(HERMES, ["a <tool", "_cal", "x> b"])[:2] == ("a <tool_calx> b", [])
    assert parse(HERMES, ["ends with <tool_ca"])[:2] == ("ends with <tool_ca", [])


def test_a_call_cut_off_keeps_its_partial_arguments() -> None:
    _text, calls, _ = parse(HERMES, [HERMES.call_text("f", '{"a": 1}')[:-14]])
    assert calls == [("f", '{"a": 1}')]


def test_whitespace_between_hermes_calls_is_not_content() -> None:
    text, calls, _ = parse(HERMES, [HERMES.calls_text(CALLS[:2]) + "\n\nDone."])
    assert (text, [n for n, _ in calls]) == ("Done.", ["get_weather", "get_time"])


def test_syntax_is_chosen_by_vocabulary() -> None:
    assert syntax_for({marker: i for i, marker in enumerate(DEEPSEEK.marker_tokens)}) is DEEPSEEK
    assert syntax_for({"<|im_start|>": 1}) is HERMES


def test_tools_and_past_calls_enter_the_prompt() -> None:
    tool = parse_tool("get_weather", "The weather", {"type": "object", "properties": {"city": {"type": "string"}}}, "t")
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "content": "cold", "tool_call_id": "c1"},
    ]
    hermes = HERMES.render_messages(messages, [tool])
    assert hermes[0]["role"] == "system" and '"name": "get_weather"' in hermes[0]["content"]
    assert hermes[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    }
    assert hermes[3] == {"role": "tool", "content": "<tool_response>\ncold\n</tool_response>"}
    deepseek = DEEPSEEK.render_messages(messages, [tool])
    assert deepseek[1:] == messages  # DeepSeek's template writes calls and results itself


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
@pytest.mark.parametrize("syntax", [DEEPSEEK, HERMES])
def test_grammars_name_the_tools_and_use_marker_tokens(syntax: ToolSyntax, mode: str) -> None:
    import xgrammar as xgr

    from engine_core.structured_output import build_grammar

    tools = [
        parse_tool(
            "get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "t"
        ),
        parse_tool("get_time", "", None, "t"),
    ]
    ids = {marker: 1000 + i for i, marker in enumerate(syntax.marker_tokens)}
    grammar = syntax.grammar(tools, ToolChoice(mode, "get_time" if mode == "named" else ""), True, ids.get)
    assert grammar.kind == "structural_tag"
    # the grammar's text-level shape: markers are tokens for DeepSeek, text for Hermes
    text = str(build_grammar(grammar))
    assert ("1000" in text) == (syntax is DEEPSEEK)
    assert ("city" in text) == ("get_weather" in text) == (mode != "named")
    assert isinstance(xgr.Grammar, type)


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"not": {"type": "string"}}, "'not'"),
        (
            {"type": "object", "properties": {"a": {"if": {}, "then": {}}}},
            "'if' is not supported by structured output (at /properties/a)",
        ),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
        ({"type": "array", "contains": {"type": "string"}}, "'contains'"),
        ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "string", "format": "phone"}, 'string format "phone"'),
        ({"type": "string", "pattern": "(?!x)y"}, "lookaround"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' with more than one"),
        ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "'oneOf'"),
        ({"$ref": "other.json#/x"}, "local '$ref'"),
        ({"type": "string", "maxLength": 10**6}, "'maxLength' must be an integer in [0, 4096]"),
        ({"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
        ({"type": "array", "items": [{"type": "string"}]}, "prefixItems"),
        ({"type": "widget"}, "unknown type"),
        # jsonschemabench's calculate_area: xgrammar enforced the properties and dropped the anyOf of 'required's
        (
            {"type": "object", "properties": {"r": {"type": "number"}}, "anyOf": [{"required": ["r"]}]},
            "'anyOf' beside other keywords of the same schema ('properties', 'type')",
        ),
    ],
)
def test_unsupported_schemas_are_named(schema: dict[str, Any], feature: str) -> None:
    with pytest.raises(Unsupported) as caught:
        check_schema(schema)
    assert feature in str(caught.value)
    with pytest.raises(GatewayError) as refused:
        json_schema_output(schema, "response_format.json_schema.schema")
    assert refused.value.http_status == 400 and refused.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 20},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            },
            "required": ["name"],
            "additionalProperties": False,
            "title": "T",
            "x-vendor": 1,
        },
        {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}], "$defs": {"a": {"type": "string", "format": "email"}}},
        {"type": "integer", "minimum": 0, "exclusiveMaximum": 100, "multipleOf": 5},
        {"type": "string", "pattern": "^[a-z]+$", "enum": ["ab", "cd"]},
    ],
)
def test_supported_schemas_pass(schema: dict[str, Any]) -> None:
    check_schema(schema)
    assert json.loads(json_schema_output(schema, "s").spec) == schema


def test_oversized_and_deep_schemas_are_refused() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(30):
        deep = {"type": "array", "items": deep}
    with pytest.raises(Unsupported, match="nest at most"):
        check_schema(deep)
    with pytest.raises(Unsupported, match="over"):
        check_schema({"type": "object", "description": "x" * 40000})


def test_the_traffic_class_is_the_clients_else_agent_with_tools_else_chat() -> None:
    plain = ChatTurn(model="m", messages=[], sampling=common_pb2.SamplingParams(), max_tokens_param="max_tokens")
    with_tools = dataclasses.replace(plain, tools=(Tool("f", "", {"type": "object", "properties": {}}),))
    assert traffic_class_of(plain) == "chat"
    assert traffic_class_of(with_tools) == "agent"
    assert traffic_class_of(dataclasses.replace(with_tools, traffic_class="batch-2")) == "batch-2"
    with pytest.raises(GatewayError) as caught:
        traffic_class_of(dataclasses.replace(plain, traffic_class="x" * 33))
    assert caught.value.param == "traffic_class"


def test_integers_past_the_wire_width_are_a_400_naming_the_clients_field() -> None:
    from services.gateway.api_models.base import validated
    from services.gateway.api_models.responses import ResponsesRequest

    # found by the fuzz test: 2**31 output tokens passed the engine's checks and overflowed the proto's int32
    body = {"model": "m", "input": "Hi"}
    with pytest.raises(GatewayError) as caught:
        validated(ResponsesRequest, {**body, "max_output_tokens": 2**31})
    assert (caught.value.http_status, caught.value.param) == (400, "max_output_tokens")
    with pytest.raises(GatewayError) as caught:
        validated(ResponsesRequest, {**body, "seed": 2**63})
    assert caught.value.param == "seed"
    widest = validated(ResponsesRequest, {**body, "max_output_tokens": 2**31 - 1, "seed": 2**63 - 1})
    assert (widest.max_output_tokens, widest.seed) == (2**31 - 1, 2**63 - 1)
