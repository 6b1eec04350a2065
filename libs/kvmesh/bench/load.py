"""A steady, bounded load on a gateway, for the fault suite and the soak: `concurrency` clients, each sending one
request after another, every request recorded (when it started and ended, how it failed, when its tokens came).

Runs in a thread of its own with its own event loop, so a caller (a test, a benchmark) injects faults meanwhile
and reads `outcomes()`. A request succeeds only when it is whole: a stream must end with `[DONE]` and report in
its usage exactly the tokens asked for (`ignore_eos`), so a stream cut short, or one that lost or repeated
tokens across a migration, counts as failed.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

KINDS = ("chat", "tools", "image", "responses")


@dataclass
class Outcome:
    kind: str  # one of KINDS ("responses": a stored response, then a follow-up naming it)
    started_s: float  # time.monotonic() when it was sent
    ended_s: float = 0.0
    error: str | None = None  # None: whole; else its kind: http_503, connection, timeout, incomplete, ...
    token_times_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk that carried text
    prefill_worker: str = ""  # x-kvmesh-prefill-worker
    decode_worker: str = ""  # x-kvmesh-decode-worker
    detail: str = ""  # the start of an error's body

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def latency_s(self) -> float:
        return self.ended_s - self.started_s

    @property
    def max_gap_s(self) -> float:
        """The longest wait between consecutive tokens (0 with fewer than two)."""
        times = self.token_times_s
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two)."""
        times = self.token_times_s
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


class RequestFailed(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail


def png(seed: int) -> str:
    """A small PNG as a data: URL, one of 8 colours (the encoder's cache sees repeats and new images)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 24), ((seed * 37) % 256, (seed * 91) % 256, (seed * 53) % 256)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Load:
    """`concurrency` clients in a loop, each request's kind taken in turn from `kinds`."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        model: str,
        concurrency: int = 3,
        kinds: tuple[str, ...] = ("chat",),
        max_tokens: int = 16,
        timeout_s: float = 60.0,
    ) -> None:
        for kind in kinds:
            if kind not in KINDS:
                raise ValueError(f"unknown request kind {kind!r}: one of {', '.join(KINDS)}")
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.model = model
        self.concurrency = concurrency
        self.kinds = kinds
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self._outcomes: list[Outcome] = []  # appended by the load's loop only
        self._in_flight: dict[int, Outcome] = {}  # likewise
        self._running = threading.Event()  # clear: clients finish their request and wait
        self._stopping = False
        self._counter = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="load", daemon=True)
        self._clients: concurrent.futures.Future[None] | None = None

    # control, from the caller's thread

    def start(self) -> Load:
        self._running.set()
        self._thread.start()
        self._clients = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        return self

    def pause(self, timeout_s: float = 120.0) -> None:
        """Let every client finish its request, then hold them (until resume())."""
        self._running.clear()
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._in_flight:
            raise TimeoutError(f"{len(self._in_flight)} requests still in flight after {timeout_s:.0f}s")

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stopping = True
        self._running.set()
        if self._clients is not None:
            self._clients.result(timeout=self.timeout_s + 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def outcomes(self) -> list[Outcome]:
        """Requests that ended, in the order they ended."""
        return list(self._outcomes)

    def in_flight(self) -> list[Outcome]:
        return list(self._in_flight.values())

    # the clients, on the load's loop

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, n) for n in range(self.concurrency)))

    async def _client(self, session: aiohttp.ClientSession, client: int) -> None:
        for step in itertools.count():
            while not self._running.is_set():
                await asyncio.sleep(0.02)
            if self._stopping:
                return
            number = next(self._counter)
            kind = self.kinds[(client + step) % len(self.kinds)]
            outcome = Outcome(kind, time.monotonic())
            self._in_flight[number] = outcome
            try:
                await self._send(session, kind, number, outcome)
            except RequestFailed as failure:
                outcome.error, outcome.detail = failure.kind, failure.detail
            except TimeoutError:
                outcome.error = "timeout"
            except aiohttp.ClientError as exc:
                outcome.error = "connection" if isinstance(exc, aiohttp.ClientConnectionError) else type(exc).__name__
            outcome.ended_s = time.monotonic()
            del self._in_flight[number]
            self._outcomes.append(outcome)
            if outcome.error is not None:
                await asyncio.sleep(0.1)  # a failing mesh is not hammered

    async def _send(self, session: aiohttp.ClientSession, kind: str, number: int, outcome: Outcome) -> None:
        if kind == "responses":
            first = await self._post(session, "/v1/responses", self._response_body(number, None), outcome)
            await self._post(session, "/v1/responses", self._response_body(number, first["id"]), outcome)
            return
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"Request {number}: tell me about the number {number % 97}."}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        if kind == "tools":
            body["tools"] = [WEATHER_TOOL]
            body["messages"][0]["content"] = f"What is the weather in city number {number}?"
            await self._post(session, "/v1/chat/completions", body, outcome)
            return
        if kind == "image":
            text = {"type": "text", "text": f"Request {number}: what is in this picture?"}
            image = {"type": "image_url", "image_url": {"url": png(number % 8)}}
            body["messages"] = [{"role": "user", "content": [text, image]}]
        body.update(stream=True, stream_options={"include_usage": True}, ignore_eos=True)
        await self._stream(session, body, outcome)

    def _response_body(self, number: int, previous_id: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "input": f"Conversation {number}: " + ("and then?" if previous_id else "tell me a short story."),
            "max_output_tokens": self.max_tokens,
            "temperature": 0,
        }
        if previous_id is not None:
            body["previous_response_id"] = previous_id
        return body

    async def _post(
        self, session: aiohttp.ClientSession, path: str, body: dict[str, Any], outcome: Outcome
    ) -> dict[str, Any]:
        async with session.post(self.base_url + path, json=body, headers=self.headers) as response:
            outcome.prefill_worker = response.headers.get("x-kvmesh-prefill-worker", "")
            outcome.decode_worker = response.headers.get("x-kvmesh-decode-worker", "")
            if response.status != 200:
                raise RequestFailed(f"http_{response.status}", (await response.text())[:300])
            try:
                result: dict[str, Any] = await response.json()
            except (json.JSONDecodeError, aiohttp.ContentTypeError):
                raise RequestFailed("bad_body") from None
            return result

    async def _stream(self, session: aiohttp.ClientSession, body: dict[str, Any], outcome: Outcome) -> None:
        async with session.post(self.base_url + "/v1/chat/completions", json=body, headers=self.headers) as response:
            outcome.prefill_worker = response.headers.get("x-kvmesh-prefill-worker", "")
            outcome.decode_worker = response.headers.get("x-kvmesh-decode-worker", "")
            if response.status != 200:
                raise RequestFailed(f"http_{response.status}", (await response.text())[:300])
            num_completion_tokens = None
            is_done = False
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    is_done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RequestFailed("stream_error", json.dumps(chunk["error"])[:300])
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    outcome.token_times_s.append(time.monotonic())
                if chunk.get("usage"):
                    num_completion_tokens = chunk["usage"]["completion_tokens"]
            if not is_done or num_completion_tokens != self.max_tokens:
                raise RequestFailed("incomplete", f"done={is_done} completion_tokens={num_completion_tokens}")
