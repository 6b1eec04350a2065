"""OpenAI's shapes that more than one API reads or writes, from their checked request models
(services/gateway/api_models): chat messages and past tool calls (also the form the chat template reads: the
gRPC API and the Responses and Messages APIs produce it too), stop strings, stream options, tool_choice,
response_format, Chat Completions' usage object and the SSE framing. No I/O here."""

from __future__ import annotations

import json
from typing import Any

from engine_core.structured_output import StructuredOutput
from services.gateway.api_models.openai import (
    AssistantMessage,
    FlatNamedToolChoice,
    ImageUrlPart,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    StreamOptions,
    SystemMessage,
    TextFormat,
    TextPart,
    ToolMessage,
    UnknownRole,
    UserMessage,
)
from services.gateway.errors import GatewayError, invalid
from services.gateway.images import IMAGE_MARKER, ImagePart, check_text
from services.gateway.pipeline import Usage
from services.gateway.schema_support import json_schema_output
from services.gateway.tool_calls import AUTO_TOOLS, NO_TOOLS, ToolChoice

AnyMessage = SystemMessage | UserMessage | AssistantMessage | ToolMessage | UnknownRole
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def content_text(
    content: str | list[TextPart] | list[TextPart | ImageUrlPart] | None, param: str, images: list[ImagePart]
) -> str:
    """The content as text: its image parts (only user messages have them: Chat Completions' `image_url`, the
    Responses API's `input_image`) join `images` and stand in the text as IMAGE_MARKER. None (an assistant's
    message with only tool calls) is no text."""
    if content is None:
        return ""
    if isinstance(content, str):
        check_text(content, param)
        return content
    texts = []
    for index, part in enumerate(content):
        part_param = f"{param}[{index}]"
        if isinstance(part, ImageUrlPart):
            images.append(ImagePart(part_param, part.url))
            texts.append(IMAGE_MARKER)
        else:
            check_text(part.text, f"{part_param}.text")
            texts.append(part.text)
    return "\n".join(texts)


def tool_call_message(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A past tool call as the chat template (and tool_calls.ToolSyntax) read it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_message(
    message: AnyMessage, param: str, images: list[ImagePart], content_field: str = "content"
) -> dict[str, Any]:
    """A checked message as the chat template reads it: roles normalized, content flattened to text."""
    assert not isinstance(message, UnknownRole), "refused when checked"
    content = content_text(message.content, f"{param}.{content_field}", images)
    parsed: dict[str, Any] = {"role": ROLES[message.role], "content": content}
    if isinstance(message, AssistantMessage) and message.tool_calls:
        parsed["tool_calls"] = [
            tool_call_message(call.id, call.function.name, call.function.arguments) for call in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        parsed["tool_call_id"] = message.tool_call_id
    return parsed


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop or []
    return tuple(s for s in stops if s)


def stream_flags(stream: bool, options: StreamOptions | None) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    return stream, options.include_usage


def tool_choice_of(choice: str | NamedToolChoice | FlatNamedToolChoice | None, has_tools: bool) -> ToolChoice:
    if choice is None:
        return AUTO_TOOLS if has_tools else NO_TOOLS
    if isinstance(choice, str):
        return ToolChoice(choice)
    return ToolChoice("named", choice.function_name)


def structured_output_of(
    fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None, param: str = "response_format"
) -> StructuredOutput | None:
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutput("json_object", "")
    if isinstance(fmt, JsonSchemaFormat):
        return json_schema_output(fmt.json_schema.schema_, f"{param}.json_schema.schema")
    return None


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _compact_json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + _compact_json(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_frame(error: GatewayError) -> bytes:
    return sse(error.body())  # the SDKs raise on a data frame carrying "error"
