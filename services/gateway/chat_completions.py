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

from services.gateway.api_models.base import validated
from services.gateway.api_models.openai import ChatCompletionRequest
from services.gateway.api_models.sampling import to_wire
from services.gateway.chat import (
    ArgsEvent,
    CallStartEvent,
    ChatEvent,
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
    chat_message,
    error_frame,
    sse,
    stop_strings,
    stream_flags,
    structured_output_of,
    tool_call_message,
    tool_choice_of,
    usage_body,
)
from services.gateway.pipeline import Usage
from services.gateway.rest import REQUEST_ID, admitted, dumps, json_body, served_headers, start_turn, stream_response
from services.gateway.tool_calls import Tool, parse_tool

CHAT_PATH = "/v1/chat/completions"
CHAT_API = "chat.completions"


@dataclass(frozen=True)
class ChatRequest:
    """A checked body: the turn chat.py runs, and what only this API's answer needs."""

    turn: ChatTurn
    max_tokens: int | None  # None: until the context is full (also in turn.sampling where set)
    stream: bool
    include_usage: bool  # stream_options.include_usage


def _tools(request: ChatCompletionRequest) -> tuple[Tool, ...]:
    return tuple(
        parse_tool(tool.function.name, tool.function.description, tool.function.parameters, f"tools[{index}].function")
        for index, tool in enumerate(request.tools)
    )


def _top_logprobs(request: ChatCompletionRequest) -> int:
    if request.top_logprobs is None:
        return 0
    if not request.logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return request.top_logprobs


def parse_chat_request(body: Any) -> ChatRequest:
    """A decoded JSON body, checked (api_models.openai.ChatCompletionRequest); the first bad field raises
    GatewayError naming it."""
    request = validated(ChatCompletionRequest, body)
    images: list[ImagePart] = []
    messages = [chat_message(message, f"messages[{index}]", images) for index, message in enumerate(request.messages)]
    tools = _tools(request)
    if request.max_completion_tokens is None:
        max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
    else:
        max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
    stream, include_usage = stream_flags(request.stream, request.stream_options)
    turn = ChatTurn(
        model=request.model,
        messages=messages,
        sampling=to_wire(request, max_tokens, max_tokens_param),
        max_tokens_param=max_tokens_param,
        stop=stop_strings(request.stop),
        tools=tools,
        tool_choice=tool_choice_of(request.tool_choice, bool(tools)),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=structured_output_of(request.response_format),
        n=request.n,
        logprobs=request.logprobs,
        top_logprobs=_top_logprobs(request),
        cache_salt=request.cache_salt,
        images=tuple(images),
    )
    return ChatRequest(turn, max_tokens, stream, include_usage)


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
        run = await start_turn(request, chat.turn, record)
        try:
            if chat.stream:
                shape = ChunkShape(
                    f"chatcmpl-{request[REQUEST_ID]}", int(time.time()), chat.turn.model, chat.include_usage
                )
                return await stream_response(request, run, record, chat_chunks(chat, run, shape), error_frame)
            results = await collect(run)
            body = completion_body(
                f"chatcmpl-{request[REQUEST_ID]}",
                int(time.time()),
                chat.turn.model,
                results,
                run.usage,
                chat.turn.logprobs,
            )
            record.finish(200)
            return web.json_response(body, headers=served_headers(request, run), dumps=dumps)
        finally:
            run.close()


async def chat_chunks(chat: ChatRequest, run: ChatRun, shape: ChunkShape) -> AsyncIterator[bytes]:
    """The stream's frames. Each choice's role chunk goes out in one write with the first frame after it (the
    first token's, known before the stream starts): one send and one wake-up of the client, not two."""
    head = b"".join(sse(shape.role(choice.index)) for choice in run.choices)
    async for event in run.events():
        frame = _event_frame(shape, event)
        if frame:
            yield head + frame
            head = b""
    if chat.include_usage:
        yield head + sse(shape.usage(run.usage))
        head = b""
    yield head + SSE_DONE


def _event_frame(shape: ChunkShape, event: ChatEvent) -> bytes:
    """The event's chunk; empty for tokens without logprobs (their text is an event of its own) and for a call's
    end (its arguments went out as deltas)."""
    if isinstance(event, TextEvent):
        return sse(shape.content(event.text, event.choice))
    if isinstance(event, TokensEvent):
        return sse(shape.logprobs(event.tokens, event.choice)) if event.tokens else b""
    if isinstance(event, CallStartEvent):
        return sse(shape.tool_call_start(event.call_index, event.call_id, event.name, event.choice))
    if isinstance(event, ArgsEvent):
        return sse(shape.tool_call_args(event.call_index, event.delta, event.choice))
    if isinstance(event, FinishEvent):
        return sse(shape.finish(event.finish_reason, event.choice))
    return b""
