"""Anthropic's Messages API (/v1/messages): content blocks (text, image, tool_use, tool_result) -> a ChatTurn,
events -> content blocks, streamed as named SSE events (the anthropic SDK drops frames without `event:`):

    message_start, ping, then per block content_block_start, content_block_delta (text_delta or
    input_json_delta)..., content_block_stop; then message_delta (stop_reason, usage) and message_stop.

Errors have Anthropic's shape (errors.py: anthropic_body); a saturated mesh answers 529 overloaded_error.
The key comes in `x-api-key` (or a Bearer token); `anthropic-version` is accepted as sent.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from services.gateway.api_models.anthropic import (
    AnthropicModeChoice,
    AnthropicNamedChoice,
    AssistantTurn,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ToolUseBlock,
    UnknownTurn,
    UserTurn,
)
from services.gateway.api_models.base import validated
from services.gateway.api_models.sampling import to_wire
from services.gateway.chat import (
    ArgsEvent,
    CallEndEvent,
    CallStartEvent,
    ChatRun,
    ChatTurn,
    ChoiceResult,
    FinishEvent,
    TextEvent,
    collect,
)
from services.gateway.errors import GatewayError
from services.gateway.images import IMAGE_MARKER, ImagePart, check_text
from services.gateway.openai_shapes import stop_strings, tool_call_message
from services.gateway.pipeline import Usage
from services.gateway.rest import admitted, dumps, json_body, served_headers, start_turn, stream_response
from services.gateway.tool_calls import AUTO_TOOLS, NO_TOOLS, Tool, ToolChoice, parse_tool

MESSAGES_PATH = "/v1/messages"
MESSAGES_API = "messages"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _text_of(blocks: str | list[TextBlock], param: str) -> str:
    if isinstance(blocks, str):
        check_text(blocks, param)
        return blocks
    for index, block in enumerate(blocks):
        check_text(block.text, f"{param}[{index}].text")
    return "\n".join(block.text for block in blocks)


def _message(
    message: UserTurn | AssistantTurn | UnknownTurn, param: str, images: list[ImagePart]
) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool_result blocks become `tool` turns before the user's text; an
    image block stands in the user's text as IMAGE_MARKER and joins `images`. Which blocks each role may send is
    the model's (api_models.anthropic)."""
    assert not isinstance(message, UnknownTurn), "refused when checked"
    role, content = message.role, message.content
    if isinstance(content, str):
        check_text(content, f"{param}.content")
        return [{"role": role, "content": content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        block_param = f"{param}.content[{index}]"
        if isinstance(block, TextBlock):
            check_text(block.text, f"{block_param}.text")
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            images.append(ImagePart(block_param, block.url))
            texts.append(IMAGE_MARKER)
        elif isinstance(block, ToolUseBlock):
            calls.append(tool_call_message(block.id, block.name, json.dumps(block.input, ensure_ascii=False)))
        else:
            output = _text_of(block.content, f"{block_param}.content")
            results.append(
                {
                    "role": "tool",
                    "content": f"Error: {output}" if block.is_error else output,
                    "tool_call_id": block.tool_use_id,
                }
            )
    out: list[dict[str, Any]] = list(results)
    if role == "assistant":
        out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_choice(
    choice: AnthropicModeChoice | AnthropicNamedChoice | None, tools: tuple[Tool, ...]
) -> tuple[ToolChoice, bool]:
    """(choice, parallel tool calls allowed)."""
    if choice is None:
        return (AUTO_TOOLS if tools else NO_TOOLS), True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, AnthropicNamedChoice):
        return ToolChoice("named", choice.name), parallel
    return ToolChoice("required" if choice.type == "any" else choice.type), parallel


def parse_messages_request(body: Any) -> tuple[ChatTurn, bool]:
    """(turn, stream), from the body checked as api_models.anthropic.MessagesRequest."""
    request = validated(MessagesRequest, body)
    images: list[ImagePart] = []
    messages = [m for i, raw in enumerate(request.messages) for m in _message(raw, f"messages[{i}]", images)]
    if request.system is not None:
        messages.insert(0, {"role": "system", "content": _text_of(request.system, "system")})
    tools = tuple(
        parse_tool(tool.name, tool.description, tool.input_schema, f"tools[{index}]")
        for index, tool in enumerate(request.tools)
    )
    choice, parallel = _tool_choice(request.tool_choice, tools)
    turn = ChatTurn(
        model=request.model,
        messages=messages,
        sampling=to_wire(request, request.max_tokens, "max_tokens"),
        max_tokens_param="max_tokens",
        stop=stop_strings(request.stop_sequences),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        images=tuple(images),
    )
    return turn, request.stream


def _usage(usage: Usage, num_output_tokens: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens if num_output_tokens is None else num_output_tokens,
    }


def _stop(result: ChoiceResult | FinishEvent) -> tuple[str, str | None]:
    if result.stop_string is not None:
        return "stop_sequence", result.stop_string
    return STOP_REASONS[result.finish_reason], None


def _message_body(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def _tool_use(call: CallEndEvent) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:  # cut off by max_tokens: Anthropic's input is an object either way
        arguments = {}
    return {"type": "tool_use", "id": call.call_id, "name": call.name, "input": arguments}


async def create_message(request: web.Request) -> web.StreamResponse:
    async with admitted(request, MESSAGES_API) as record:
        turn, stream = parse_messages_request(await json_body(request))
        run = await start_turn(request, turn, record)
        message_id = "msg_" + secrets.token_hex(12)
        try:
            if stream:
                return await stream_response(request, run, record, _frames(message_id, turn.model, run), error_frame)
            [result] = await collect(run)
            content = ([{"type": "text", "text": result.text}] if result.text else []) + [
                _tool_use(call) for call in result.calls
            ]
            body = _message_body(message_id, turn.model, content, _stop(result), _usage(run.usage))
            record.finish(200)
            return web.json_response(body, headers=served_headers(request, run), dumps=dumps)
        finally:
            run.close()


def _event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {dumps({'type': kind, **fields})}\n\n".encode()


def error_frame(error: GatewayError) -> bytes:
    return f"event: error\ndata: {dumps(error.anthropic_body())}\n\n".encode()


async def _frames(message_id: str, model: str, run: ChatRun) -> AsyncIterator[bytes]:
    yield _event(
        "message_start",
        message=_message_body(message_id, model, [], (None, None), _usage(run.usage, num_output_tokens=0)),
    )
    yield _event("ping")
    block = -1
    is_text_open = is_tool_open = False
    stop: tuple[str, str | None] = ("end_turn", None)
    async for event in run.events():
        if isinstance(event, TextEvent):
            if not is_text_open:
                block += 1
                is_text_open = True
                yield _event("content_block_start", index=block, content_block={"type": "text", "text": ""})
            yield _event("content_block_delta", index=block, delta={"type": "text_delta", "text": event.text})
        elif isinstance(event, CallStartEvent):
            if is_text_open:
                yield _event("content_block_stop", index=block)
                is_text_open = False
            block += 1
            is_tool_open = True
            yield _event(
                "content_block_start",
                index=block,
                content_block={"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}},
            )
        elif isinstance(event, ArgsEvent):
            yield _event(
                "content_block_delta", index=block, delta={"type": "input_json_delta", "partial_json": event.delta}
            )
        elif isinstance(event, CallEndEvent):
            is_tool_open = False
            yield _event("content_block_stop", index=block)
        elif isinstance(event, FinishEvent):
            stop = _stop(event)
    if is_text_open or is_tool_open:  # a call cut off by max_tokens is closed too
        yield _event("content_block_stop", index=block)
    yield _event(
        "message_delta",
        delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
        usage={"output_tokens": run.usage.completion_tokens},
    )
    yield _event("message_stop")
