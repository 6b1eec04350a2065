"""An `LLMEngine` on its own thread, driven from asyncio (the services' event loops).

The engine thread is the only one that touches the engine. asyncio code runs engine operations between
steps with `await call(fn)` and receives each request's outputs on its own queue. Steps run back to back
while there is work; when idle the thread sleeps until a call arrives.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine_core.engine import EngineStats, LLMEngine
from engine_core.kv_cache.events import KVCacheEvent
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import RequestOutput
from engine_core.structured_output import GrammarError

T = TypeVar("T")

# Called on the engine thread after each step that changed the prefix cache, so a hook can read the KV of
# newly stored blocks before they could be evicted.
KVEventHook = Callable[[LLMEngine, list[KVCacheEvent]], None]


GRAMMAR_TIMEOUT_S = 10.0  # a grammar that compiles longer is refused (grammar blow-ups are an attack)


class EngineFailure(RuntimeError):
    """The engine failed while computing a request (not the request's fault); it was aborted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_kv_events: KVEventHook | None = None, name: str = "engine") -> None:
        self.engine = engine
        self.on_kv_events = on_kv_events
        self.stats: EngineStats = engine.stats()  # replaced (never mutated) by the engine thread: each step, call
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], asyncio.Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; its exceptions are raised here."""
        assert self._loop is not None, "start() first"
        future: asyncio.Future[T] = self._loop.create_future()
        self._calls.put((fn, future))
        self._wake.set()
        return await future

    def call_soon(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn(engine) on the engine thread between steps, without waiting for it."""
        assert self._loop is not None, "start() first"
        self._calls.put((fn, self._loop.create_future()))
        self._wake.set()

    async def prepare_grammar(self, params: SamplingParams, timeout_s: float = GRAMMAR_TIMEOUT_S) -> None:
        """Compile the request's grammar, if any, on a worker thread (the engine thread only finds it in the
        cache then). Past `timeout_s` it fails with GrammarError; the compile runs on but the request is refused."""
        structured = params.structured_output
        if structured is None or self.engine.grammars.is_cached(structured):
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.engine.grammars.compile, structured), timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(f"the {structured.kind} grammar took over {timeout_s:g} s to compile") from None

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | BaseException]:
        """The queue that will receive the request's outputs; open it before the request can produce any."""
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def follow(
        self, request_id: str, stream: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abort it if the caller stops listening first."""
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.close_stream(request_id)
            if not finished:  # no await here: this may run while the caller is being cancelled
                self.call_soon(lambda engine: engine.abort_request(request_id))

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        stream = self.open_stream(request_id)
        try:
            await self.call(lambda engine: engine.add_request(request_id, prompt, params, **kwargs))
        except BaseException:
            self.close_stream(request_id)
            raise
        async for output in self.follow(request_id, stream):
            yield output

    # -- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._run_calls()
            if not self.engine.has_unfinished_requests():
                self.stats = self.engine.stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug or a device fault: fail what was running, keep serving
                self._fail_all(exc)
                continue
            self.stats = self.engine.stats()
            if outputs:  # first: the hook below may copy megabytes, and tokens should not wait for it
                self._post(self._deliver, outputs)
            events = self.engine.take_kv_events()
            if events and self.on_kv_events is not None:
                self.on_kv_events(self.engine, events)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                outcome: tuple[Callable[..., None], Any] = (_set_result, fn(self.engine))
            except BaseException as exc:
                outcome = (_set_exception, exc)
            self.stats = self.engine.stats()  # so a caller that awaited the call sees what it changed
            self._post(outcome[0], future, outcome[1])

    def _fail_all(self, exc: Exception) -> None:
        scheduler = self.engine.scheduler
        request_ids = [r.request_id for r in list(scheduler.running) + list(scheduler.waiting)]
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        self.engine.step()  # collect the abort outputs so the scheduler forgets them
        failure = EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}")
        self._post(self._fail_streams, request_ids, failure)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_streams(self, request_ids: list[str], failure: EngineFailure) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(failure)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
