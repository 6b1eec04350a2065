"""An `LLMEngine` on its own thread, driven from asyncio (the services' event loops).

The engine thread is the only one that touches the engine: the `LLMEngine` is private to `AsyncEngine`, and its
`engine` accessor raises anywhere but on that thread. asyncio code runs engine operations between steps with
`await call(fn)` and receives each request's outputs on its own queue; it reads the engine's state only through
what this class offers: facts fixed at load (`kv_layout`, `max_model_len`, ...), snapshots the engine thread
replaces after each step and call (`stats`, `num_expert_steps`), and the few engine parts built to be used from
any thread (layer loads, grammar compilation, preparing an expert placement). Steps run back to back while there
is work; when idle the thread sleeps until a call arrives.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from engine_core.engine import EngineStats, LLMEngine
from engine_core.expert_parallel import ExpertLayout, PreparedPlacement
from engine_core.kv_cache.block_hash import KeySpan
from engine_core.kv_cache.events import KVCacheEvent
from engine_core.kv_load import LayerLoad
from engine_core.kv_transfer import KVLayout
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import RequestOutput

T = TypeVar("T")

# Called on the engine thread after each step that changed the prefix cache, so a hook can read the KV of
# newly stored blocks before they could be evicted.
KVEventHook = Callable[[LLMEngine, list[KVCacheEvent]], None]


GRAMMAR_TIMEOUT_S = 10.0  # a grammar that compiles longer is refused (grammar blow-ups are an attack)


class EngineFailure(RuntimeError):
    """The engine failed while computing a request (not the request's fault); it was aborted."""


class WrongThreadError(RuntimeError):
    """The inner engine was touched from a thread other than its own."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_kv_events: KVEventHook | None = None, name: str = "engine") -> None:
        self._engine = engine  # touched only by the engine thread (and here, before it starts)
        self.on_kv_events = on_kv_events
        # Fixed at load, never written again: read from any thread.
        self.kv_layout: KVLayout = engine.kv_layout
        self.max_model_len: int = engine.max_model_len
        self.served_name: str = engine.served_name
        self.vocab_size: int = engine.model_config.vocab_size
        self.expert_layout: ExpertLayout | None = engine.expert_layout  # None without MoE layers
        # Snapshots replaced (never mutated) by the engine thread after each step and each call.
        self.stats: EngineStats = engine.stats()
        self.num_expert_steps = 0  # steps counted towards the next expert load report
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], asyncio.Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def engine(self) -> LLMEngine:
        """The inner engine, for code already on the engine thread (a `call`ed function gets it as its argument;
        this is for debugging and tests). Raises WrongThreadError on any other thread."""
        if threading.current_thread() is not self._thread:
            raise WrongThreadError(
                f"the engine is owned by thread {self._thread.name!r}: use AsyncEngine.call, not .engine, "
                f"from {threading.current_thread().name!r}"
            )
        return self._engine

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
        cache then). Past `timeout_s` it fails with GrammarError; the compile runs on, holding its slot, but the
        request is refused. The cap is per worker: requests carry no tenant here."""
        structured = params.structured_output
        if structured is not None:  # on the compiler's own bounded threads (structured_output.GrammarCompiler)
            await self._engine.grammars.compile_async(structured, timeout_s)

    def prompt_block_hashes(
        self, prompt_token_ids: list[int], cache_salt: str | None = None, key_spans: Sequence[KeySpan] = ()
    ) -> list[bytes]:
        """The keys of the prompt's full blocks (LLMEngine.prompt_block_hashes): a function of the block size and
        served name only, both fixed at load, so any thread may call it."""
        return self._engine.prompt_block_hashes(prompt_token_ids, cache_salt, key_spans)

    # -- layer-by-layer loads (engine_core.kv_load): begun on the engine thread, written from any thread ---------
    def write_layer(self, load: LayerLoad, layer: int, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
        """One layer of every block of a load begun by a `call` (LayerLoads.write_layer, which locks)."""
        self._engine.loads.write_layer(load, layer, pieces)

    def fail_load(self, load: LayerLoad) -> None:
        """The load's data will not come: the engine recomputes its blocks (LayerLoads.fail, which locks)."""
        self._engine.loads.fail(load)

    # -- expert placements (engine_core.expert_parallel) ----------------------------------------------------------
    async def prepare_expert_placement(self, phy2log: Sequence[Sequence[int]], version: int) -> PreparedPlacement:
        """Build a placement's weights on a worker thread while the engine keeps stepping (it reads weights that
        change only when a placement is applied, which happens on the engine thread with `call`)."""
        return await asyncio.to_thread(self._engine.prepare_expert_placement, phy2log, version)

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | BaseException]:
        """The queue that will receive the request's outputs; open it before the request can produce any."""
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def follow(
        self, request_id: str, stream: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncGenerator[RequestOutput, None]:
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
            if not self._engine.has_unfinished_requests():
                self._snapshot()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self._engine.step()
            except Exception as exc:  # a bug or a device fault: fail what was running, keep serving
                self._fail_all(exc)
                continue
            self._snapshot()
            if outputs:  # first: the hook below may copy megabytes, and tokens should not wait for it
                self._post(self._deliver, outputs)
            events = self._engine.take_kv_events()
            if events and self.on_kv_events is not None:
                self.on_kv_events(self._engine, events)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                outcome: tuple[Callable[..., None], Any] = (_set_result, fn(self._engine))
            except BaseException as exc:
                outcome = (_set_exception, exc)
            self._snapshot()  # so a caller that awaited the call sees what it changed
            self._post(outcome[0], future, outcome[1])

    def _snapshot(self) -> None:
        self.stats = self._engine.stats()
        experts = self._engine.experts
        self.num_expert_steps = 0 if experts is None else experts.num_steps

    def _fail_all(self, exc: Exception) -> None:
        scheduler = self._engine.scheduler
        request_ids = [r.request_id for r in list(scheduler.running) + list(scheduler.waiting)]
        for request_id in request_ids:
            self._engine.abort_request(request_id)
        self._engine.step()  # collect the abort outputs so the scheduler forgets them
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
