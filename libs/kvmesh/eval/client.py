"""One streamed request over aiohttp -> a RequestOutcome: when each piece of output arrived, the server's usage,
the text and tool calls. Chat Completions, Responses and Anthropic Messages, each in its own SSE dialect.

Times are taken when a server-sent event's line is read, so TTFT is the first event that carries output (text
or a tool call), and each inter-token gap is the time between two such events. A server that sends several tokens
in one event makes fewer, longer gaps; TPOT divides by the server's token count instead (docs/evaluation.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass
class RequestOutcome:
    source: str  # the workload line ("file:line") it came from
    turn: int  # the turn of its conversation (0 for a single request)
    api: str
    model: str
    scheduled_s: float  # when it was due, from the start of the repeat
    sent_s: float = 0.0  # when it was sent (later than scheduled_s while --concurrency held it)
    ttft_s: float | None = None
    e2e_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between consecutive events that carried output
    prompt_tokens: int = 0  # the server's usage, all of these
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float | None = None  # the server's `server-timing: prefill;dur=` when it sends one
    text: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # {"name", "arguments"} in order
    error: str | None = None  # its kind: http_<status>, connection, timeout, disconnected, stream_error
    error_message: str = ""
    quality: dict[str, Any] = field(default_factory=dict)  # filled by quality.judge

    @property
    def is_ok(self) -> bool:
        return self.error is None


def request_headers(api: str, api_key: str) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {api_key}"}
    if api == "messages":
        headers.update({"x-api-key": api_key, "anthropic-version": "2023-06-01"})
    return headers


def streamed_body(api: str, body: dict[str, Any], cache_salt: str) -> dict[str, Any]:
    streamed = {**body, "stream": True}
    if api == "chat":
        streamed["stream_options"] = {"include_usage": True}
    if cache_salt and api != "messages" and "cache_salt" not in body:
        streamed["cache_salt"] = cache_salt
    return streamed


async def send(
    session: aiohttp.ClientSession, base_url: str, api_key: str, record: RequestOutcome, body: dict[str, Any], t0: float
) -> RequestOutcome:
    """Send one request and fill `record`; `t0` is the repeat's start (time.perf_counter)."""
    start = time.perf_counter()
    record.sent_s = start - t0
    parser = EventParser(record.api, record)
    last: float | None = None
    try:
        async with session.post(
            base_url + PATHS[record.api], json=body, headers=request_headers(record.api, api_key)
        ) as response:
            if response.status != 200:
                record.error = f"http_{response.status}"
                record.error_message = (await response.text())[:500]
                return record
            record.prefill_s = _prefill_seconds(response.headers.get("server-timing", ""))
            async for raw in response.content:
                if not parser.feed(raw.decode("utf-8", errors="replace").rstrip("\r\n")):
                    continue
                now = time.perf_counter()
                if last is None:
                    record.ttft_s = now - start
                else:
                    record.gaps_s.append(now - last)
                last = now
        record.e2e_s = time.perf_counter() - start
        if parser.error:
            record.error, record.error_message = "stream_error", parser.error[:500]
    except asyncio.TimeoutError:
        record.error, record.error_message = "timeout", "no answer within the client's timeout"
    except aiohttp.ClientConnectorError as exc:
        record.error, record.error_message = "connection", str(exc)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        record.error, record.error_message = "disconnected", str(exc) or type(exc).__name__
    return record


def _prefill_seconds(timing: str) -> float | None:
    for part in timing.split(","):
        name, _, duration = part.strip().partition(";dur=")
        if name == "prefill":
            try:
                return float(duration) / 1000
            except ValueError:
                return None
    return None


class EventParser:
    """Feeds an API's SSE lines into a record. `feed` says whether the line carried output (a token event)."""

    def __init__(self, api: str, record: RequestOutcome) -> None:
        self.api = api
        self.record = record
        self.error = ""
        self._calls: dict[Any, dict[str, str]] = {}  # the API's call index or item id -> its call, in order

    def feed(self, line: str) -> bool:
        if not line.startswith("data:"):
            return False
        payload = line[5:].strip()
        if payload == "[DONE]":
            return False
        try:
            data = json.loads(payload)
        except json.JSONDecodeError:
            self.error = f"not JSON in the stream: {payload[:200]}"
            return False
        if not isinstance(data, dict):
            return False
        if "error" in data and (self.api == "chat" or data.get("type") in ("error", "response.failed")):
            self.error = json.dumps(data["error"]) if not isinstance(data["error"], str) else data["error"]
            return False
        is_output = {"chat": self._chat, "responses": self._responses, "messages": self._messages}[self.api](data)
        self.record.tool_calls = list(self._calls.values())
        return is_output

    def _call(self, key: Any) -> dict[str, str]:
        return self._calls.setdefault(key, {"name": "", "arguments": ""})

    def _chat(self, data: dict[str, Any]) -> bool:
        if data.get("usage"):
            self._usage(data["usage"], "prompt_tokens", "completion_tokens")
            self.record.cached_tokens = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if not data.get("choices"):
            return False
        delta = data["choices"][0].get("delta") or {}
        is_output = bool(delta.get("content"))
        self.record.text += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            target = self._call(call.get("index", 0))
            target["name"] += function.get("name") or ""
            target["arguments"] += function.get("arguments") or ""
            is_output = is_output or bool(function.get("name") or function.get("arguments"))
        return is_output

    def _responses(self, data: dict[str, Any]) -> bool:
        kind = data.get("type")
        if kind == "response.output_text.delta":
            self.record.text += data.get("delta", "")
            return bool(data.get("delta"))
        if kind == "response.output_item.added" and (data.get("item") or {}).get("type") == "function_call":
            self._call(data["item"].get("id"))["name"] = data["item"].get("name", "")
            return True
        if kind == "response.function_call_arguments.delta":
            self._call(data.get("item_id"))["arguments"] += data.get("delta", "")
            return bool(data.get("delta"))
        if kind in ("response.completed", "response.incomplete"):
            usage = (data.get("response") or {}).get("usage") or {}
            self._usage(usage, "input_tokens", "output_tokens")
            self.record.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return False

    def _messages(self, data: dict[str, Any]) -> bool:
        kind = data.get("type")
        if kind == "message_start":
            usage = (data.get("message") or {}).get("usage") or {}
            self.record.cached_tokens = usage.get("cache_read_input_tokens") or 0
            self.record.prompt_tokens = (usage.get("input_tokens") or 0) + self.record.cached_tokens
        elif kind == "content_block_start" and (data.get("content_block") or {}).get("type") == "tool_use":
            self._call(data.get("index"))["name"] = data["content_block"].get("name", "")
            return True
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta":
                self.record.text += delta.get("text", "")
                return bool(delta.get("text"))
            if delta.get("type") == "input_json_delta":
                self._call(data.get("index"))["arguments"] += delta.get("partial_json", "")
                return bool(delta.get("partial_json"))
        elif kind == "message_delta":
            self.record.completion_tokens = ((data.get("usage") or {}).get("output_tokens")) or 0
        return False

    def _usage(self, usage: dict[str, Any], prompt_key: str, completion_key: str) -> None:
        self.record.prompt_tokens = usage.get(prompt_key) or 0
        self.record.completion_tokens = usage.get(completion_key) or 0
