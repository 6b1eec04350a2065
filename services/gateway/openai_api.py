"""OpenAI Chat Completions: a request body -> ChatRequest (every field checked, errors naming it), and
completions, stream chunks and usage -> JSON. No I/O here.

Beside OpenAI's fields, vLLM's extensions that clients send through `extra_body` are honoured: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, cache_salt. Unknown fields are ignored; fields this server
cannot honour yet (tools, response_format, logprobs, ...) are refused by name, never silently dropped."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mesh.pb import common_pb2
from services.gateway.errors import invalid
from services.gateway.pipeline import Usage
from services.gateway.sampling import openai_to_wire

MAX_STOP_STRINGS = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields we cannot honour yet: refused by name rather than silently ignored.
UNSUPPORTED = ("tools", "functions", "response_format", "logprobs", "top_logprobs", "logit_bias")
FINISH_REASONS: dict[int, str] = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]  # {"role", "content"}, content flattened to text, roles normalized
    sampling: common_pb2.SamplingParams
    max_tokens: int | None  # None: until the context is full
    max_tokens_param: str  # the field the client set it with, for errors: max_tokens | max_completion_tokens
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage
    cache_salt: str  # vLLM's extension: enters every block key, so differently salted prompts never share KV


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_KINDS = {"number": _is_number, "integer": _is_int, "boolean": lambda v: isinstance(v, bool),
          "string": lambda v: isinstance(v, str), "object": lambda v: isinstance(v, dict),
          "array": lambda v: isinstance(v, list)}


def _field(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """body[name] if it has the right JSON type; null or absent gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not _KINDS[kind](value):
        raise invalid(name, f"'{name}' must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}")
    return value


def _content_text(content: Any, role: str, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise invalid(param, f"'{param}' must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        part_param = f"{param}[{index}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid(part_param, f"'{part_param}' must be a text part: {{\"type\": \"text\", \"text\": ...}}")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{part_param}.text", f"'{part_param}.text' must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list):
        raise invalid("messages", "'messages' must be an array")
    if not raw:
        raise invalid("messages", "'messages' must not be empty")
    messages = []
    for index, message in enumerate(raw):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(param, f"'{param}' must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{param}.role", f"'{param}.role' must be one of system, developer, user, assistant"
                          f" (got {json.dumps(role)[:40]})")
        content = _content_text(message.get("content"), role, f"{param}.content")
        messages.append({"role": ROLES[role], "content": content})
    return messages


def _parse_stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "'stop' must be a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return tuple(s for s in stops if s)


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
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


def _check_unsupported(body: dict[str, Any]) -> None:
    n = _field(body, "n", "integer", 1)
    if n != 1:
        raise invalid("n", f"only n=1 is supported, got {n}")
    for name in UNSUPPORTED:
        value = body.get(name)
        if value in (None, False, [], {}) or (name == "response_format" and value == {"type": "text"}):
            continue
        raise invalid(name, f"'{name}' is not supported by this server yet")


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a decoded JSON body field by field; the first bad field raises GatewayError naming it."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' must be a non-empty string")
    messages = parse_messages(body.get("messages"))
    _check_unsupported(body)
    max_completion_tokens = _field(body, "max_completion_tokens", "integer")
    max_tokens_param = "max_tokens" if max_completion_tokens is None else "max_completion_tokens"
    max_tokens = _field(body, "max_tokens", "integer") if max_completion_tokens is None else max_completion_tokens
    stream, include_usage = _parse_stream(body)
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
    return ChatRequest(model=model, messages=messages, sampling=sampling, max_tokens=max_tokens,
                       max_tokens_param=max_tokens_param, stop=_parse_stop(body), stream=stream,
                       include_usage=include_usage, cache_salt=_field(body, "cache_salt", "string", ""))


# ---- responses -------------------------------------------------------------------------------------------

def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def completion_body(completion_id: str, created: int, model: str, text: str, finish_reason: str,
                    usage: Usage) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
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
        chunk: dict[str, Any] = {"id": self.completion_id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.model, "system_fingerprint": None,
                                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def role(self) -> dict[str, Any]:
        return self._chunk([self._choice({"role": "assistant", "content": ""}, None)])

    def content(self, text: str) -> dict[str, Any]:
        return self._chunk([self._choice({"content": text}, None)])

    def finish(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk([self._choice({}, finish_reason)])

    def usage(self, usage: Usage) -> dict[str, Any]:
        assert self.include_usage, "a usage chunk only when the client asked for it"
        return {**self._chunk([]), "usage": usage_body(usage)}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
