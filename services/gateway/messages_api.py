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
from services.gateway.errors import GatewayError, invalid
from services.gateway.images import IMAGE_MARKER, ImagePart, check_text
from services.gateway.openai_shapes import field_of, parse_stop, tool_call_message
from services.gateway.pipeline import Usage
from services.gateway.rest import admitted, dumps, json_body, served_headers, start_turn, stream_response
from services.gateway.sampling import openai_to_wire
from services.gateway.tool_calls import Tool, ToolChoice, parse_tool

MESSAGES_PATH = "/v1/messages"
MESSAGES_API = "messages"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _text_of(blocks: Any, param: str) -> str:
    if isinstance(blocks, str):
        check_text(blocks, param)
        return blocks
    if not isinstance(blocks, list):
        raise invalid(param, f"'{param}' must be a string or an array of text blocks")
    texts = []
    for index, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{param}[{index}]", f"'{param}[{index}]' must be a text block")
        check_text(block["text"], f"{param}[{index}].text")
        texts.append(block["text"])
    return "\n".join(texts)


def _image(block: dict[str, Any], param: str) -> ImagePart:
    """{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}} or a "url" source."""
    source = block.get("source")
    if not isinstance(source, dict):
        source = {}
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return ImagePart(param, f"data:{source['media_type']};base64,{source['data']}")
    if kind == "url" and isinstance(source.get("url"), str):
        return ImagePart(param, source["url"])
    raise invalid(
        f"{param}.source",
        f'\'{param}.source\' must be {{"type": "base64", "media_type": '
        '"image/png", "data": ...} or {"type": "url", "url": ...}',
    )


def _message(message: Any, param: str, images: list[ImagePart]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool_result blocks become `tool` turns before the user's text; an
    image block stands in the user's text as IMAGE_MARKER and joins `images`."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise invalid(f"{param}.role", f"'{param}.role' must be 'user' or 'assistant'")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        check_text(content, f"{param}.content")
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{param}.content", f"'{param}.content' must be a string or an array of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        block_param = f"{param}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            check_text(block["text"], f"{block_param}.text")
            texts.append(block["text"])
        elif kind == "image" and role == "user":
            images.append(_image(block, block_param))
            texts.append(IMAGE_MARKER)
        elif (
            kind == "tool_use"
            and role == "assistant"
            and isinstance(block.get("name"), str)
            and isinstance(block.get("input", {}), dict)
        ):
            calls.append(
                tool_call_message(
                    str(block.get("id", "")), block["name"], json.dumps(block.get("input", {}), ensure_ascii=False)
                )
            )
        elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
            output = _text_of(block.get("content", ""), f"{block_param}.content")
            results.append(
                {
                    "role": "tool",
                    "content": f"Error: {output}" if block.get("is_error") else output,
                    "tool_call_id": block["tool_use_id"],
                }
            )
        else:
            raise invalid(
                block_param,
                f"'{block_param}' must be a text block, an image or tool_result block (user) "
                "or a tool_use block (assistant)",
            )
    out: list[dict[str, Any]] = list(results)
    if role == "assistant":
        out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_choice(raw: Any, tools: tuple[Tool, ...]) -> tuple[ToolChoice, bool]:
    """(choice, parallel tool calls allowed)."""
    if raw is None:
        return ToolChoice("auto" if tools else "none"), True
    kind = raw.get("type") if isinstance(raw, dict) else None
    parallel = not (isinstance(raw, dict) and raw.get("disable_parallel_tool_use") is True)
    if kind in ("auto", "none"):
        return ToolChoice(kind), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "tool" and isinstance(raw.get("name"), str):
        return ToolChoice("named", raw["name"]), parallel
    raise invalid(
        "tool_choice", '\'tool_choice\' must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}'
    )


def parse_messages_request(body: Any) -> tuple[ChatTurn, bool]:
    """(turn, stream)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' must be a non-empty string")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise invalid("max_tokens", "'max_tokens' is required and must be an integer")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise invalid("messages", "'messages' must be a non-empty array")
    images: list[ImagePart] = []
    messages = [m for i, raw in enumerate(raw_messages) for m in _message(raw, f"messages[{i}]", images)]
    if body.get("system") is not None:
        messages.insert(0, {"role": "system", "content": _text_of(body["system"], "system")})
    tools = []
    for index, tool in enumerate(field_of(body, "tools", "array", [])):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{index}]", f"'tools[{index}]' must be an object")
        tools.append(parse_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), f"tools[{index}]"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tuple(tools))
    sampling = openai_to_wire(
        temperature=field_of(body, "temperature", "number", 1.0),
        top_p=field_of(body, "top_p", "number", 1.0),
        max_tokens=max_tokens,
        top_k=field_of(body, "top_k", "integer", 0),
    )
    turn = ChatTurn(
        model=model,
        messages=messages,
        sampling=sampling,
        max_tokens_param="max_tokens",
        stop=parse_stop(body, "stop_sequences"),
        tools=tuple(tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        images=tuple(images),
    )
    return turn, bool(field_of(body, "stream", "boolean", False))


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
