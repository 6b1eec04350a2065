"""OpenAI Chat Completions: a request body -> ChatRequest (every field checked, errors naming it), and
completions, stream chunks and usage -> JSON. No I/O here.

Beside OpenAI's fields, vLLM's extensions that clients send through `extra_body` are honoured: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, cache_salt. Unknown fields are ignored; fields this server
cannot honour (logit_bias, the deprecated functions) are refused by name, never silently dropped."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine_core.structured_output import StructuredOutput
from mesh.pb import common_pb2
from services.gateway.chat import MAX_N, ChatTurn, ChoiceResult, TokenInfo
from services.gateway.errors import invalid
from services.gateway.images import IMAGE_MARKER, ImagePart, check_text, parse_image_part
from services.gateway.pipeline import Usage
from services.gateway.sampling import openai_to_wire
from services.gateway.schema_support import json_schema_output
from services.gateway.tool_calls import NO_TOOLS, Tool, ToolChoice, parse_tool

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Fields we cannot honour: refused by name rather than silently ignored.
UNSUPPORTED = ("functions", "function_call", "logit_bias", "audio", "modalities", "prediction")
FINISH_REASONS: dict[int, str] = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # role, content (flattened to text), tool_calls / tool_call_id; roles normalized
    sampling: common_pb2.SamplingParams
    max_tokens: int | None  # None: until the context is full
    max_tokens_param: str  # the field the client set it with, for errors: max_tokens | max_completion_tokens
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage
    cache_salt: str  # vLLM's extension: enters every block key, so differently salted prompts never share KV
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = NO_TOOLS
    parallel_tool_calls: bool = True
    response_format: StructuredOutput | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    images: tuple[ImagePart, ...] = ()  # image_url parts in order (their markers are in the messages' content)

    def turn(self) -> ChatTurn:
        return ChatTurn(
            model=self.model,
            messages=self.messages,
            sampling=self.sampling,
            max_tokens_param=self.max_tokens_param,
            stop=self.stop,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format,
            n=self.n,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            cache_salt=self.cache_salt,
            images=self.images,
        )


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


_field = field_of


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


def parse_messages(raw: Any, images: list[ImagePart] | None = None) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise invalid("messages", "'messages' must be an array")
    if not raw:
        raise invalid("messages", "'messages' must not be empty")
    return [parse_message(message, f"messages[{index}]", images) for index, message in enumerate(raw)]


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


_parse_stop = parse_stop


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_field(body, "stream", "boolean", False))
    options = _field(body, "stream_options", "object")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage", "'stream_options.include_usage' must be a boolean")
    return stream, bool(include_usage)


_parse_stream = parse_stream


def _check_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise invalid(name, f"'{name}' is not supported by this server")


def _parse_tools(body: dict[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice]:
    raw = _field(body, "tools", "array", [])
    tools = []
    for index, tool in enumerate(raw):
        param = f"tools[{index}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise invalid(param, f'\'{param}\' must be {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        tools.append(
            parse_tool(
                function.get("name"), function.get("description"), function.get("parameters"), f"{param}.function"
            )
        )
    return tuple(tools), parse_tool_choice(body.get("tool_choice"), bool(tools))


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


def _parse_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    logprobs = bool(_field(body, "logprobs", "boolean", False))
    top = _field(body, "top_logprobs", "integer")
    if top is None:
        return logprobs, 0
    if not logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
    return logprobs, top


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a decoded JSON body field by field; the first bad field raises GatewayError naming it."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' must be a non-empty string")
    images: list[ImagePart] = []
    messages = parse_messages(body.get("messages"), images)
    _check_unsupported(body)
    n = _field(body, "n", "integer", 1)
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"'n' must be between 1 and {MAX_N}, got {n}")
    tools, tool_choice = _parse_tools(body)
    max_completion_tokens = _field(body, "max_completion_tokens", "integer")
    max_tokens_param = "max_tokens" if max_completion_tokens is None else "max_completion_tokens"
    max_tokens = _field(body, "max_tokens", "integer") if max_completion_tokens is None else max_completion_tokens
    stream, include_usage = _parse_stream(body)
    logprobs, top_logprobs = _parse_logprobs(body)
    sampling = openai_to_wire(
        temperature=_field(body, "temperature", "number", 1.0),
        top_p=_field(body, "top_p", "number", 1.0),
        max_tokens=max_tokens,
        seed=_field(body, "seed", "integer"),
        presence_penalty=_field(body, "presence_penalty", "number", 0.0),
        frequency_penalty=_field(body, "frequency_penalty", "number", 0.0),
        top_k=_field(body, "top_k", "integer", 0),
        min_p=_field(body, "min_p", "number", 0.0),
        repetition_penalty=_field(body, "repetition_penalty", "number", 1.0),
        min_tokens=_field(body, "min_tokens", "integer", 0),
        ignore_eos=_field(body, "ignore_eos", "boolean", False),
        param_names={"max_tokens": max_tokens_param},
    )
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        stop=_parse_stop(body),
        stream=stream,
        include_usage=include_usage,
        cache_salt=_field(body, "cache_salt", "string", ""),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=bool(_field(body, "parallel_tool_calls", "boolean", True)),
        response_format=parse_response_format(body.get("response_format")),
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        images=tuple(images),
    )


# ---- responses -------------------------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def logprobs_body(tokens: list[TokenInfo]) -> dict[str, Any]:
    def entry(token: str, logprob: float, raw: bytes) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {
                **entry(t.token, t.logprob, t.token_bytes),
                "top_logprobs": [entry(text, lp, raw) for text, lp, raw in t.top],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def message_body(result: ChoiceResult) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": result.text if result.text or not result.calls else None,
        "refusal": None,
    }
    if result.calls:
        message["tool_calls"] = [tool_call_message(c.call_id, c.name, c.arguments) for c in result.calls]
    return message


def completion_body(
    completion_id: str, created: int, model: str, results: list[ChoiceResult], usage: Usage, with_logprobs: bool = False
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": r.index,
                "message": message_body(r),
                "logprobs": logprobs_body(r.logprobs) if with_logprobs else None,
                "finish_reason": r.finish_reason,
            }
            for r in results
        ],
        "usage": usage_body(usage),
    }


@dataclass(frozen=True)
class ChunkShape:
    """The chunks of one streamed completion. With include_usage every chunk carries `usage: null` and
    one extra last chunk has `choices: []` and the totals; without it no chunk has a usage field."""

    completion_id: str
    created: int
    model: str
    include_usage: bool

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(
        self, delta: dict[str, Any], finish_reason: str | None, index: int = 0, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def role(self, index: int = 0) -> dict[str, Any]:
        return self._chunk([self._choice({"role": "assistant", "content": ""}, None, index)])

    def content(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._chunk([self._choice({"content": text}, None, index)])

    def logprobs(self, tokens: list[TokenInfo], index: int = 0) -> dict[str, Any]:
        return self._chunk([self._choice({}, None, index, logprobs_body(tokens))])

    def tool_call_start(self, call_index: int, call_id: str, name: str, index: int = 0) -> dict[str, Any]:
        call = {"index": call_index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        return self._chunk([self._choice({"tool_calls": [call]}, None, index)])

    def tool_call_args(self, call_index: int, delta: str, index: int = 0) -> dict[str, Any]:
        call = {"index": call_index, "function": {"arguments": delta}}
        return self._chunk([self._choice({"tool_calls": [call]}, None, index)])

    def finish(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk([self._choice({}, finish_reason, index)])

    def usage(self, usage: Usage) -> dict[str, Any]:
        assert self.include_usage, "a usage chunk only when the client asked for it"
        return {**self._chunk([]), "usage": usage_body(usage)}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
