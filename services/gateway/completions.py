"""OpenAI's legacy Completions (/v1/completions): a prompt (text or token ids) -> a ChatTurn with no messages,
run as chat.py runs every API, and `text_completion` objects back, whole or streamed; `echo` and the legacy
`logprobs` (token strings, offsets, top alternatives as a dict) included."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

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
from services.gateway.errors import invalid
from services.gateway.openai_shapes import SSE_DONE, error_frame, field_of, parse_stop, parse_stream, sse, usage_body
from services.gateway.pipeline import Usage
from services.gateway.rest import REQUEST_ID, admitted, dumps, json_body, served_headers, start_turn, stream_response
from services.gateway.sampling import openai_to_wire

COMPLETIONS_PATH = "/v1/completions"
COMPLETIONS_API = "completions"
MAX_LEGACY_LOGPROBS = 5


def _parse_prompt(raw: Any) -> str | list[int]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return raw
    raise invalid("prompt", "'prompt' must be a string or an array of token ids (one prompt per request)")


def parse_completion_request(body: Any) -> tuple[ChatTurn, bool, bool, bool, int | None]:
    """(turn, stream, include_usage, echo, logprobs)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' must be a non-empty string")
    prompt = _parse_prompt(body.get("prompt"))
    for name in ("suffix", "logit_bias"):
        if body.get(name) not in (None, "", {}):
            raise invalid(name, f"'{name}' is not supported by this server")
    if field_of(body, "best_of", "integer", 1) != 1:
        raise invalid("best_of", "only best_of=1 is supported")
    logprobs = field_of(body, "logprobs", "integer")
    if logprobs is not None and not 0 <= logprobs <= MAX_LEGACY_LOGPROBS:
        raise invalid("logprobs", f"'logprobs' must be between 0 and {MAX_LEGACY_LOGPROBS}")
    stream, include_usage = parse_stream(body)
    sampling = openai_to_wire(
        temperature=field_of(body, "temperature", "number", 1.0),
        top_p=field_of(body, "top_p", "number", 1.0),
        max_tokens=field_of(body, "max_tokens", "integer", 16),
        seed=field_of(body, "seed", "integer"),
        presence_penalty=field_of(body, "presence_penalty", "number", 0.0),
        frequency_penalty=field_of(body, "frequency_penalty", "number", 0.0),
        top_k=field_of(body, "top_k", "integer", 0),
        min_p=field_of(body, "min_p", "number", 0.0),
        repetition_penalty=field_of(body, "repetition_penalty", "number", 1.0),
        min_tokens=field_of(body, "min_tokens", "integer", 0),
        ignore_eos=field_of(body, "ignore_eos", "boolean", False),
    )
    turn = ChatTurn(
        model=model,
        messages=[],
        sampling=sampling,
        max_tokens_param="max_tokens",
        stop=parse_stop(body),
        n=field_of(body, "n", "integer", 1),
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        cache_salt=field_of(body, "cache_salt", "string", ""),
        traffic_class="",
        prompt_param="prompt",
        prompt=prompt,
    )
    return turn, stream, include_usage, bool(field_of(body, "echo", "boolean", False)), logprobs


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
