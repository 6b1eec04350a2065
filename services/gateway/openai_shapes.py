"""OpenAI's shapes that more than one API reads or writes: a JSON field of the right type (`field_of`, whose
errors name the field), chat messages and past tool calls (also the form the chat template reads: the gRPC API
and the Responses and Messages APIs produce it too), stop strings, stream options, tool_choice,
response_format, Chat Completions' usage object and the SSE framing. No I/O here."""

from __future__ import annotations

import json
from typing import Any

from engine_core.structured_output import StructuredOutput
from services.gateway.errors import GatewayError, invalid
from services.gateway.images import IMAGE_MARKER, ImagePart, check_text, parse_image_part
from services.gateway.pipeline import Usage
from services.gateway.schema_support import json_schema_output
from services.gateway.tool_calls import ToolChoice

MAX_STOP_STRINGS = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_KINDS = {
    "number": _is_number,
    "integer": _is_int,
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def field_of(body: dict[str, Any], name: str, kind: str, default: Any = None, param: str | None = None) -> Any:
    """body[name] if it has the right JSON type; null or absent gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not _KINDS[kind](value):
        param = param or name
        raise invalid(param, f"'{param}' must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}")
    return value


def content_text(content: Any, role: str, param: str, images: list[ImagePart] | None = None) -> str:
    """The content as text. With `images`, a user message's image parts (Chat Completions' `image_url`, the
    Responses API's `input_image`) are appended to it and stand in the text as IMAGE_MARKER; without, only text
    parts are taken."""
    if isinstance(content, str):
        if images is not None:
            check_text(content, param)
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise invalid(param, f"'{param}' must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        part_param = f"{param}[{index}]"
        if images is not None and isinstance(part, dict) and part.get("type") in ("image_url", "input_image"):
            if role != "user":
                raise invalid(part_param, f"'{part_param}': images are taken in user messages only")
            images.append(parse_image_part(part, part_param))
            texts.append(IMAGE_MARKER)
            continue
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
            kinds = "a text or image_url part" if images is not None else "a text part"
            raise invalid(part_param, f'\'{part_param}\' must be {kinds}: {{"type": "text", "text": ...}}')
        if not isinstance(part.get("text"), str):
            raise invalid(f"{part_param}.text", f"'{part_param}.text' must be a string")
        if images is not None:
            check_text(part["text"], f"{part_param}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def tool_call_message(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A past tool call as the chat template (and tool_calls.ToolSyntax) read it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _parse_tool_calls(raw: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise invalid(param, f"'{param}' must be an array")
    calls = []
    for index, call in enumerate(raw):
        call_param = f"{param}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(
                call_param,
                f'\'{call_param}\' must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
            )
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise invalid(f"{call_param}.function.arguments", "tool call arguments must be a JSON string")
        call_id = call.get("id")
        calls.append(tool_call_message(call_id if isinstance(call_id, str) else "", function["name"], arguments))
    return calls


def parse_message(
    message: Any, param: str, images: list[ImagePart] | None = None, content_field: str = "content"
) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise invalid(param, f"'{param}' must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(
            f"{param}.role",
            f"'{param}.role' must be one of system, developer, user, assistant, tool (got {json.dumps(role)[:40]})",
        )
    content = content_text(message.get("content"), role, f"{param}.{content_field}", images)
    parsed: dict[str, Any] = {"role": ROLES[role], "content": content}
    if role == "assistant" and message.get("tool_calls"):
        parsed["tool_calls"] = _parse_tool_calls(message["tool_calls"], f"{param}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{param}.tool_call_id", f"'{param}.tool_call_id' must be a non-empty string")
        parsed["tool_call_id"] = call_id
    return parsed


def parse_stop(body: dict[str, Any], name: str = "stop") -> tuple[str, ...]:
    stop = body.get(name)
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid(name, f"'{name}' must be a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(name, f"'{name}' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return tuple(s for s in stops if s)


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(field_of(body, "stream", "boolean", False))
    options = field_of(body, "stream_options", "object")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage", "'stream_options.include_usage' must be a boolean")
    return stream, bool(include_usage)


def parse_tool_choice(raw: Any, has_tools: bool) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if has_tools else "none")
    if raw in ("none", "auto", "required"):
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = (raw.get("function") or {}).get("name") if isinstance(raw.get("function"), dict) else raw.get("name")
        if isinstance(name, str) and name:
            return ToolChoice("named", name)
    raise invalid(
        "tool_choice",
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
    )


def parse_response_format(raw: Any, param: str = "response_format") -> StructuredOutput | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "")
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid(
                f"{param}.json_schema", f"'{param}.json_schema' must be an object with a 'name' and a 'schema'"
            )
        return json_schema_output(spec.get("schema", {}), f"{param}.json_schema.schema")
    raise invalid(param, f"'{param}.type' must be 'text', 'json_object' or 'json_schema'")


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
