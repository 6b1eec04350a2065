"""OpenAI's Chat Completions (/v1/chat/completions): a request body -> ChatRequest (every field checked, errors
naming it), run as a chat turn (chat.py), and completions, stream chunks and usage -> JSON.

Beside OpenAI's fields, vLLM's extensions that clients send through `extra_body` are honoured: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, cache_salt. Unknown fields are ignored; fields this server
cannot honour (logit_bias, the deprecated functions) are refused by name, never silently dropped."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine_core.structured_output import StructuredOutput
from mesh.pb import common_pb2
from services.gateway.chat import (
    MAX_N,
    ArgsEvent,
    CallStartEvent,
    ChatRun,
    ChatTurn,
    ChoiceResult,
    FinishEvent,
    TextEvent,
    TokenInfo,
    TokensEvent,
    collect,
)
from services.gateway.errors import invalid
from services.gateway.images import ImagePart
from services.gateway.openai_shapes import (
    SSE_DONE,
    error_frame,
    field_of,
    parse_message,
    parse_response_format,
    parse_stop,
    parse_stream,
    parse_tool_choice,
    sse,
    tool_call_message,
    usage_body,
)
from services.gateway.pipeline import Usage
from services.gateway.rest import REQUEST_ID, admitted, dumps, json_body, served_headers, start_turn, stream_response
from services.gateway.sampling import openai_to_wire
from services.gateway.tool_calls import NO_TOOLS, Tool, ToolChoice, parse_tool

CHAT_PATH = "/v1/chat/completions"
CHAT_API = "chat.completions"
MAX_TOP_LOGPROBS = 20
# Fields we cannot honour: refused by name rather than silently ignored.
UNSUPPORTED = ("functions", "function_call", "logit_bias", "audio", "modalities", "prediction")


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


def parse_messages(raw: Any, images: list[ImagePart] | None = None) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise invalid("messages", "'messages' must be an array")
    if not raw:
        raise invalid("messages", "'messages' must not be empty")
    return [parse_message(message, f"messages[{index}]", images) for index, message in enumerate(raw)]


def _check_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise invalid(name, f"'{name}' is not supported by this server")


def _parse_tools(body: dict[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice]:
    raw = field_of(body, "tools", "array", [])
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


def _parse_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    logprobs = bool(field_of(body, "logprobs", "boolean", False))
    top = field_of(body, "top_logprobs", "integer")
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
    n = field_of(body, "n", "integer", 1)
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"'n' must be between 1 and {MAX_N}, got {n}")
    tools, tool_choice = _parse_tools(body)
    max_completion_tokens = field_of(body, "max_completion_tokens", "integer")
    max_tokens_param = "max_tokens" if max_completion_tokens is None else "max_completion_tokens"
    max_tokens = field_of(body, "max_tokens", "integer") if max_completion_tokens is None else max_completion_tokens
    stream, include_usage = parse_stream(body)
    logprobs, top_logprobs = _parse_logprobs(body)
    sampling = openai_to_wire(
        temperature=field_of(body, "temperature", "number", 1.0),
        top_p=field_of(body, "top_p", "number", 1.0),
        max_tokens=max_tokens,
        seed=field_of(body, "seed", "integer"),
        presence_penalty=field_of(body, "presence_penalty", "number", 0.0),
        frequency_penalty=field_of(body, "frequency_penalty", "number", 0.0),
        top_k=field_of(body, "top_k", "integer", 0),
        min_p=field_of(body, "min_p", "number", 0.0),
        repetition_penalty=field_of(body, "repetition_penalty", "number", 1.0),
        min_tokens=field_of(body, "min_tokens", "integer", 0),
        ignore_eos=field_of(body, "ignore_eos", "boolean", False),
        param_names={"max_tokens": max_tokens_param},
    )
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        stop=parse_stop(body),
        stream=stream,
        include_usage=include_usage,
        cache_salt=field_of(body, "cache_salt", "string", ""),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=bool(field_of(body, "parallel_tool_calls", "boolean", True)),
        response_format=parse_response_format(body.get("response_format")),
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        images=tuple(images),
    )


# ---- the bodies ----------------------------------------------------------------------------------------


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


# ---- the handler ---------------------------------------------------------------------------------------


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    async with admitted(request, CHAT_API) as record:
        chat = parse_chat_request(await json_body(request))
        run = await start_turn(request, chat.turn(), record)
        try:
            if chat.stream:
                shape = ChunkShape(f"chatcmpl-{request[REQUEST_ID]}", int(time.time()), chat.model, chat.include_usage)
                return await stream_response(request, run, record, _chat_chunks(chat, run, shape), error_frame)
            results = await collect(run)
            body = completion_body(
                f"chatcmpl-{request[REQUEST_ID]}", int(time.time()), chat.model, results, run.usage, chat.logprobs
            )
            record.finish(200)
            return web.json_response(body, headers=served_headers(request, run), dumps=dumps)
        finally:
            run.close()


async def _chat_chunks(chat: ChatRequest, run: ChatRun, shape: ChunkShape) -> AsyncIterator[bytes]:
    for choice in run.choices:
        yield sse(shape.role(choice.index))
    async for event in run.events():
        if isinstance(event, TextEvent):
            yield sse(shape.content(event.text, event.choice))
        elif isinstance(event, TokensEvent) and event.tokens:
            yield sse(shape.logprobs(event.tokens, event.choice))
        elif isinstance(event, CallStartEvent):
            yield sse(shape.tool_call_start(event.call_index, event.call_id, event.name, event.choice))
        elif isinstance(event, ArgsEvent):
            yield sse(shape.tool_call_args(event.call_index, event.delta, event.choice))
        elif isinstance(event, FinishEvent):
            yield sse(shape.finish(event.finish_reason, event.choice))
    if chat.include_usage:
        yield sse(shape.usage(run.usage))
    yield SSE_DONE
