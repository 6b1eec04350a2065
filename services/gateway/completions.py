"""OpenAI's legacy Completions (/v1/completions): a prompt (text or token ids) -> a ChatTurn with no messages,
run as chat.py runs every API, and `text_completion` objects back, whole or streamed; `echo` and the legacy
`logprobs` (token strings, offsets, top alternatives as a dict) included."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from services.gateway.api_models.base import validated
from services.gateway.api_models.openai import CompletionRequest
from services.gateway.api_models.sampling import to_wire
from services.gateway.chat import (
    ChatRun,
    ChatTurn,
    ChoiceResult,
    FinishEvent,
    TextEvent,
    TokenInfo,
    TokensEvent,
    collect,
)
from services.gateway.openai_shapes import SSE_DONE, error_frame, sse, stop_strings, stream_flags, usage_body
from services.gateway.pipeline import Usage
from services.gateway.rest import REQUEST_ID, admitted, dumps, json_body, served_headers, start_turn, stream_response

COMPLETIONS_PATH = "/v1/completions"
COMPLETIONS_API = "completions"


def parse_completion_request(body: Any) -> tuple[ChatTurn, bool, bool, bool, int | None]:
    """(turn, stream, include_usage, echo, logprobs), from the body checked as api_models.openai.CompletionRequest."""
    request = validated(CompletionRequest, body)
    asked = request.max_tokens if "max_tokens" in request.model_fields_set else None
    stream, include_usage = stream_flags(request.stream, request.stream_options)
    turn = ChatTurn(
        model=request.model,
        messages=[],
        sampling=to_wire(request, asked, "max_tokens"),
        max_tokens_param="max_tokens",
        api_max_tokens=None if asked is not None else request.max_tokens,  # OpenAI's 16, where the client set none
        stop=stop_strings(request.stop),
        n=request.n,
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
        cache_salt=request.cache_salt,
        traffic_class="",
        prompt_param="prompt",
        prompt=request.prompt_value,
    )
    return turn, stream, include_usage, request.echo, request.logprobs


def _legacy_logprobs(tokens: list[TokenInfo], offset: int) -> dict[str, Any]:
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{text: lp for text, lp, _ in t.top} for t in tokens],
        "text_offset": offsets,
    }


def _completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _completion(completion_id: str, model: str, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


async def create_completion(request: web.Request) -> web.StreamResponse:
    async with admitted(request, COMPLETIONS_API) as record:
        turn, stream, include_usage, echo, logprobs = parse_completion_request(await json_body(request))
        run = await start_turn(request, turn, record)
        completion_id = f"cmpl-{request[REQUEST_ID]}"
        prefix = turn.prompt if echo and isinstance(turn.prompt, str) else ""
        try:
            if stream:
                return await stream_response(
                    request,
                    run,
                    record,
                    _completion_chunks(completion_id, turn.model, run, prefix, include_usage),
                    error_frame,
                )
            results: list[ChoiceResult] = await collect(run)
            choices = [
                _completion_choice(
                    r.index,
                    prefix + r.text,
                    r.finish_reason,
                    _legacy_logprobs(r.logprobs, len(prefix)) if logprobs is not None else None,
                )
                for r in results
            ]
            record.finish(200)
            return web.json_response(
                _completion(completion_id, turn.model, choices, run.usage),
                headers=served_headers(request, run),
                dumps=dumps,
            )
        finally:
            run.close()


async def _completion_chunks(
    completion_id: str, model: str, run: ChatRun, prefix: str, include_usage: bool
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        body = _completion(completion_id, model, choices, None)
        if include_usage:
            body["usage"] = usage_body(usage) if usage is not None else None
        return sse(body)

    if prefix:
        for choice in run.choices:
            yield chunk([_completion_choice(choice.index, prefix, None, None)])
    async for event in run.events():
        if isinstance(event, TextEvent):
            yield chunk([_completion_choice(event.choice, event.text, None, None)])
        elif isinstance(event, TokensEvent) and event.tokens:
            yield chunk([_completion_choice(event.choice, "", None, _legacy_logprobs(event.tokens, 0))])
        elif isinstance(event, FinishEvent):
            yield chunk([_completion_choice(event.choice, "", event.finish_reason, None)])
    if include_usage:
        yield chunk([], run.usage)
    yield SSE_DONE
