"""The prefill role's core: compute a prompt's KV, sample the first token, hand the KV to a decode worker.

One request, in order:
  1. its cached prefix: blocks this engine holds, then the blocks after them that the KV store holds, as many
     of those as are predicted to be quicker read than computed again (fetch_decision.py); store blocks enter
     the prefix cache right before the request is admitted (one engine call, so nothing evicts them in between);
  2. the request runs with the user's sampling but one token, kept (keep_kv) so its KV survives finishing;
  3. unless that token already ends the request, the KV is exported and pushed to the decode worker: the one the
     job names (early binding), or, when it names none (late binding), the one a balancer binds as the KV becomes
     ready (`DecodeBinder`), told to the caller with the first token. The push starts only after the first token
     (the export reads finished blocks), so binding then delays no push. A prompt the engine's next step computes
     whole (nothing queued ahead, within one step's tokens) is bound as that step starts, the balancer call
     running beside the compute instead of after it; any other is bound once its first token is sampled;
  4. the kept request is always released (success, failure or cancellation).
Talking to decode, to the balancers and to the store is behind small interfaces (`KVPusher`, `DecodeBinder`,
`StoreReader`) implemented by the gRPC clients; this module holds no gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from engine_core import LLMEngine, RequestOutput, SamplingParams
from engine_core.async_engine import AsyncEngine, EngineFailure
from engine_core.kv_cache.block_hash import root_hash
from engine_core.kv_load import LayerLoad
from engine_core.kv_transfer import KVChunk, KVExport
from engine_core.request import EmbeddingSpan, TokenLogprobs
from mesh.compute.engines import ModelEngines
from mesh.kv_blocks import KVLayout
from mesh.logging import get_logger
from mesh.tracing import BYTES_MOVED, current_span, span
from services.prefill.fetch_decision import FetchDecision, FetchPlanner, FetchQuestion

log = get_logger(__name__)


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the user's
    cache_salt: str | None  # tenant salt: enters every block key
    decode_address: str  # "": late binding, a balancer names the decode worker once the first token is sampled
    decode_worker_id: str
    decode_data_address: str = ""  # the decode worker's bulk lane: the push goes there when set
    traffic_class: str = ""  # agent | chat | ...: the TTL class of the blocks it writes to the KV store
    images: tuple[EmbeddingSpan, ...] = ()  # embeddings at the prompt's image placeholders (from the encoder)
    output_token_ids: tuple[int, ...] = ()  # a migrated generation's output so far (computed with the prompt)
    exclude_decode_worker_ids: tuple[str, ...] = ()  # late binding: decode workers the balancer must not pick
    canary: bool = False  # late binding: on a canary rollout's side (the route's), where the decode worker must be


@dataclass(frozen=True)
class DecodeTarget:
    """A decode worker to push a request's KV to (late binding: the one a balancer bound)."""

    worker_id: str
    address: str  # gRPC
    data_address: str = ""  # its bulk lane, when it has one


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprob: TokenLogprobs | None  # when the user asked for logprobs
    finish_reason: str | None  # set when the first token ends the request (then nothing was pushed)
    num_prompt_tokens: int
    num_cached_tokens: int  # not computed here: device cache and KV store hits
    num_store_tokens: int  # of those, fetched from the KV store
    prefill_seconds: float  # admission to the first token
    kv_bytes_sent: int
    queue_seconds: float = 0.0  # of prefill_seconds, the wait before the engine first scheduled it
    fetch: FetchDecision | None = None  # fetch or recompute, when the store held blocks past the engine's prefix
    decode: DecodeTarget | None = None  # late binding: the decode worker bound for the KV (None: early, or nothing)


@dataclass(frozen=True)
class StoreBlock:
    """One block as the KV store holds it: every layer's KV, layer 0 first."""

    block_hash: bytes
    parent_hash: bytes
    layout: KVLayout
    data: bytes


class StoreReader(Protocol):
    """The KV store, read side. A failure is a miss: `fetch` never raises."""

    def is_available(self) -> bool: ...

    def note_prompt(self, block_hashes: Sequence[bytes], traffic_class: str) -> None:
        """A prompt's block keys in order and its request's class: the TTL and price of these blocks when written."""
        ...

    async def fetch(self, model: str, block_hashes: Sequence[bytes]) -> list[StoreBlock]:
        """The stored blocks for the first keys, in order, up to the first one not found."""
        ...

    def stored(self, block_hashes: Sequence[bytes]) -> list[bool] | None:
        """Per key, whether the store may hold it (False: `fetch` and `plan_stream` will not find it); None when
        that is not known without asking the nodes."""
        ...

    def note_skipped(self) -> None:
        """A read `stored` made needless: the store holds nothing after the engine's cached prefix."""
        ...

    def streams_layers(self) -> bool:
        """Whether a read now would be layer-major (`plan_stream` may return a stream), overlapping the compute."""
        ...

    def plan_stream(self, model: str, block_hashes: Sequence[bytes]) -> StoreStream | None:
        """A layer-major read of the leading blocks that feeds a load while the engine computes (None: `fetch`)."""
        ...


class StoreStream(Protocol):
    """A planned read of a prefix from the KV store, fed into a layer-by-layer load (engine_core.kv_load)."""

    block_hashes: list[bytes]  # the blocks it will read, in order

    async def run(
        self, layout: KVLayout, num_blocks: int, write_layer: Callable[[int, list[memoryview]], None]
    ) -> bool:
        """Read the first `num_blocks`, calling write_layer(layer, each block's bytes of it) in layer order as
        layers complete (the last one only once every block passed its checksum); True when all were written."""
        ...


class PushError(RuntimeError):
    """The KV did not reach the decode worker. `is_exhausted`: it had no room; else it failed or is unreachable."""

    def __init__(self, message: str, decode_worker_id: str, is_exhausted: bool) -> None:
        super().__init__(message)
        self.decode_worker_id = decode_worker_id
        self.is_exhausted = is_exhausted


class BindError(RuntimeError):
    """No balancer named a decode worker for a request's KV (late binding): none reachable, or none to offer."""


class DecodeBinder(Protocol):
    async def bind(self, job: PrefillJob, num_kv_tokens: int) -> DecodeTarget:
        """The decode worker for the job's KV, ready now (`num_kv_tokens`: prompt and output so far). Raises
        BindError."""
        ...


class KVPusher(Protocol):
    async def push(self, job: PrefillJob, export: KVExport, chunks: AsyncIterator[KVChunk]) -> int:
        """Hand the KV to job.decode_address; returns the bytes sent. Raises PushError."""
        ...


@dataclass(frozen=True)
class _StoreHit:
    """Blocks fetched from the store, to enter the prefix cache as a chain after `parent_hash`."""

    parent_hash: bytes
    block_hashes: list[bytes]
    token_ids: list[int]  # the blocks' tokens
    blocks_data: list[bytes]
    num_local_blocks: int  # blocks before these that the device cache held
    stream: StoreStream | None = None  # set instead of blocks_data: the blocks arrive while the request computes


@dataclass(frozen=True)
class _Lookup:
    """The prompt's blocks the store could add to the engine's cached prefix, found on the event loop."""

    block_hashes: list[bytes]  # the prompt's full blocks, but the one holding the last token
    stored: list[bool] | None  # per block, whether the store may hold it; None: unknown

    def may_extend(self, num_local: int) -> bool:
        """Whether the store may hold the block after the `num_local` ones the engine has."""
        if num_local == len(self.block_hashes):
            return False
        return self.stored is None or self.stored[num_local]


# Called on the engine thread with the keys just injected from the store (the store has them already).
InjectedHook = Callable[[str, list[bytes]], None]


class Prefiller:
    def __init__(
        self,
        engines: ModelEngines,
        pusher: KVPusher,
        store: StoreReader | None = None,
        on_injected: InjectedHook = lambda model, block_hashes: None,
        max_chunk_bytes: int | None = None,
        critical: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        planner: FetchPlanner | None = None,
        binder: DecodeBinder | None = None,
    ) -> None:
        self.engines = engines
        self.binder = binder  # late binding's balancer client (None: every job must name its decode worker)
        self.critical = critical  # wraps each request's path to its first token (background work waits)
        self.pusher = pusher
        self.store = store
        self.on_injected = on_injected
        self.max_chunk_bytes = max_chunk_bytes
        self.planner = planner or FetchPlanner()  # fetch or recompute; learns from this worker's reads and computes
        self._active: set[str] = set()  # request ids in flight; written only here, on the event loop

    async def prefill(
        self, job: PrefillJob, on_first: Callable[[PrefillResult], None] = lambda result: None
    ) -> PrefillResult:
        """Raises UnknownModelError, ValueError (bad prompt or parameters), PushError, EngineFailure.
        `on_first` gets the result as soon as the first token is known, before the KV push (kv_bytes_sent 0)."""
        engine = self.engines.get(job.model)
        if not job.decode_address and self.binder is None:
            raise ValueError("decode_address is required: this worker has no balancer to bind a decode worker")
        first_params = first_token_params(job.params, len(job.output_token_ids))
        if job.request_id in self._active:  # its stream and its kept KV would collide with the other's
            raise ValueError(f"duplicate request id {job.request_id!r}")
        self._active.add(job.request_id)
        try:
            with self.critical():
                return await self._prefill(engine, job, first_params, on_first)
        finally:
            self._active.discard(job.request_id)

    async def _prefill(
        self,
        engine: AsyncEngine,
        job: PrefillJob,
        first_params: SamplingParams,
        on_first: Callable[[PrefillResult], None],
    ) -> PrefillResult:
        arrived = time.monotonic()
        outer = contextvars.copy_context()  # the request's span: where a binding started later is traced
        await engine.prepare_grammar(job.params)  # off the engine thread, bounded; GrammarError: a bad request
        lookup = self._lookup(engine, job)
        request_id = job.request_id
        outputs = engine.open_stream(request_id)
        feeding: asyncio.Task[None] | None = None
        binding: asyncio.Task[DecodeTarget] | None = None  # a decode worker bound while the prompt computes
        hit: _StoreHit | None = None
        decision: FetchDecision | None = None
        num_injected, load = 0, None
        try:
            started = time.monotonic()
            num_local, is_admitted, is_next = await self._admit_unless_stored(engine, job, first_params, lookup)
            if not is_admitted:
                assert lookup is not None, "only a lookup defers the admission"
                decision = self._decide(engine, job, lookup, num_local)
                if decision.num_fetch_blocks:
                    hit = await self._fetch_from_store(engine, job, lookup, num_local, decision.num_fetch_blocks)
            elif self.store is not None and lookup is not None and num_local < len(lookup.block_hashes):
                self.store.note_skipped()
            if is_admitted:
                binding = self._bind_ahead(job, is_next, outer)
            with span("kvmesh.prefill.compute") as computing:
                if not is_admitted:
                    started = time.monotonic()
                    num_injected, load, is_next = await engine.call(lambda e: self._admit(e, job, first_params, hit))
                    binding = self._bind_ahead(job, is_next, outer)
                feeding = self._feed(engine, job, hit, load)
                first = await _first_output(engine, request_id, outputs)
                computing.set_attribute("kvmesh.num_computed_tokens", first.num_prompt_tokens - first.num_cached_tokens)
            computed = time.monotonic()
            seconds = computed - started
            finish_reason = self._finish_reason(job, first)
            block_size = self.engines.layout(job.model).block_size
            result = PrefillResult(
                first_token_id=first.new_token_ids[0],
                first_logprob=first.new_logprobs[0] if first.new_logprobs else None,
                finish_reason=finish_reason,
                num_prompt_tokens=first.num_prompt_tokens,
                num_cached_tokens=first.num_cached_tokens,
                num_store_tokens=_num_store_tokens(first.num_cached_tokens, hit, num_injected, block_size),
                prefill_seconds=seconds,
                kv_bytes_sent=0,
                queue_seconds=max((first.first_scheduled_at or started) - started, 0.0),
                fetch=decision,
            )
            if hit is None or hit.stream is None:  # no read ran alongside: the engine's own pace
                self.planner.observe_compute(
                    first.num_prompt_tokens - first.num_cached_tokens, seconds - result.queue_seconds
                )
            if finish_reason is None and not job.decode_address:
                job = await self._bind(job, binding)
                result = dataclasses.replace(
                    result, decode=DecodeTarget(job.decode_worker_id, job.decode_address, job.decode_data_address)
                )
            on_first(result)
            if finish_reason is None:
                with span("kvmesh.kv.push", attributes={"kvmesh.decode_worker_id": job.decode_worker_id}) as pushing:
                    export = await engine.call(lambda e: e.export_kv(request_id))
                    num_bytes = await self.pusher.push(job, export, self._read_chunks(export))
                    pushing.set_attribute(BYTES_MOVED, num_bytes)
                result = dataclasses.replace(result, kv_bytes_sent=num_bytes)
            log.debug(
                "prefill timing",
                store_ms=round((started - arrived) * 1000, 2),
                compute_ms=round(seconds * 1000, 2),
                push_ms=round((time.monotonic() - computed) * 1000, 2),
            )
        finally:
            engine.close_stream(request_id)
            engine.call_soon(lambda e: _discard(e, request_id))
            _settle(feeding)
            _settle(binding)
        return result

    def _bind_ahead(
        self, job: PrefillJob, is_next: bool, outer: contextvars.Context
    ) -> asyncio.Task[DecodeTarget] | None:
        """Late binding for a prompt the engine's next step computes whole: the balancer call starts now, beside
        that step, rather than after the first token (one balancer round trip off the TTFT). What the balancer
        sees is then at most one step older than the KV. None when the job names its decode worker, when the
        prompt takes more than the next step, or when the first token surely ends the request (nothing to bind;
        a stop token cannot be foreseen: that binding goes unused, as an early binding's does)."""
        if job.decode_address or self.binder is None or not is_next:
            return None
        if self._ends_by_length(job, len(job.prompt_token_ids)):
            return None
        return asyncio.get_running_loop().create_task(self._bind_call(job, "admission"), context=outer)

    async def _bind(self, job: PrefillJob, binding: asyncio.Task[DecodeTarget] | None) -> PrefillJob:
        """Late binding: the job, now naming the decode worker a balancer bound for its KV (the binding started
        at admission, or one now)."""
        target = await binding if binding is not None else await self._bind_call(job, "first_token")
        return dataclasses.replace(
            job,
            decode_address=target.address,
            decode_worker_id=target.worker_id,
            decode_data_address=target.data_address,
        )

    async def _bind_call(self, job: PrefillJob, moment: str) -> DecodeTarget:
        """The balancer call, traced (carrying the span's traceparent); `moment` says when it was made."""
        assert self.binder is not None, "checked when the job came"
        num_kv_tokens = len(job.prompt_token_ids) + len(job.output_token_ids)
        attributes = {"kvmesh.num_kv_tokens": num_kv_tokens, "kvmesh.decode.bind_at": moment}
        with span("kvmesh.decode.bind", attributes=attributes) as binding:
            target = await self.binder.bind(job, num_kv_tokens)
            binding.set_attribute("kvmesh.decode_worker_id", target.worker_id)
        return target

    async def _admit_unless_stored(
        self, engine: AsyncEngine, job: PrefillJob, params: SamplingParams, lookup: _Lookup | None
    ) -> tuple[int, bool, bool]:
        """How many of the lookup's blocks the engine holds, whether the request was admitted, and whether the
        next step computes it whole: in one engine call (each waits for the step in flight), unless the store may
        hold the next block (then the caller fetches it and admits). The call is the device cache's lookup, so it
        is traced as one."""
        if lookup is None:
            return await engine.call(lambda e: self._admit_now(e, job, params, None))
        with span("kvmesh.kv.read device", attributes=_read_attributes("lookup", len(lookup.block_hashes))) as reading:
            num_local, is_admitted, is_next = await engine.call(lambda e: self._admit_now(e, job, params, lookup))
            reading.set_attribute("kvmesh.kv.num_blocks", num_local)
        return num_local, is_admitted, is_next

    def _admit_now(
        self, engine: LLMEngine, job: PrefillJob, params: SamplingParams, lookup: _Lookup | None
    ) -> tuple[int, bool, bool]:
        """On the engine thread: `_admit_unless_stored`'s count, admission and next-step answer."""
        num_local = 0 if lookup is None else engine.num_cached_blocks(lookup.block_hashes)
        if lookup is not None and lookup.may_extend(num_local):
            return num_local, False, False
        _, _, is_next = self._admit(engine, job, params, None)
        return num_local, True, is_next

    def _admit(
        self, engine: LLMEngine, job: PrefillJob, params: SamplingParams, hit: _StoreHit | None
    ) -> tuple[int, LayerLoad | None, bool]:
        """On the engine thread: enter the store's blocks, then the request (so it finds them still cached);
        also whether the next step computes it whole (`_is_next_step`)."""
        num_injected, load = 0, None
        if hit is not None and hit.stream is not None:  # cached now, their KV written layer by layer as it comes
            load = engine.loads.begin(hit.parent_hash, hit.block_hashes, hit.token_ids)
            num_injected = load.num_blocks
        elif hit is not None:
            num_injected = engine.inject_cached_blocks(
                hit.parent_hash, hit.block_hashes, hit.token_ids, hit.blocks_data
            )
        if hit is not None:
            self.on_injected(job.model, hit.block_hashes[:num_injected])
        engine.add_request(
            job.request_id,
            job.prompt_token_ids,
            params,
            cache_salt=job.cache_salt,
            keep_kv=True,
            embeddings=job.images,
            output_token_ids=job.output_token_ids,
        )
        return num_injected, load, _is_next_step(engine, len(job.prompt_token_ids) + len(job.output_token_ids))

    def _feed(
        self, engine: AsyncEngine, job: PrefillJob, hit: _StoreHit | None, load: LayerLoad | None
    ) -> asyncio.Task[None] | None:
        """Stream the store's blocks into the load while the request computes; the load fails (and the engine
        recomputes) unless every layer was written."""
        if hit is None or hit.stream is None or load is None or load.num_blocks == 0:
            return None
        stream, layout = hit.stream, self.engines.layout(job.model)

        async def feed() -> None:
            is_complete = False
            try:
                with span("kvmesh.kv.read store", attributes=_read_attributes("stream", load.num_blocks)) as reading:
                    began = time.monotonic()
                    is_complete = await stream.run(
                        layout, load.num_blocks, lambda layer, pieces: engine.write_layer(load, layer, pieces)
                    )
                    reading.set_attribute("kvmesh.kv.is_complete", is_complete)
                if is_complete:
                    self.planner.observe_read(load.num_blocks * layout.num_block_bytes, time.monotonic() - began)
            except Exception:
                log.warning("KV store stream failed; its blocks are recomputed", exc_info=True)
            finally:
                if not is_complete:
                    engine.fail_load(load)

        return asyncio.create_task(feed())

    def _finish_reason(self, job: PrefillJob, first: RequestOutput) -> str | None:
        """Whether prefill's one token ends the request for real: a stop, max_tokens reached, or a full context."""
        if first.finish_reason == "stop":
            return "stop"
        return "length" if self._ends_by_length(job, first.num_prompt_tokens) else None

    def _ends_by_length(self, job: PrefillJob, num_prompt_tokens: int) -> bool:
        """Whether prefill's one token reaches max_tokens or fills the context: known before it is sampled."""
        num_outputs = len(job.output_token_ids) + 1
        return job.params.max_tokens == num_outputs or num_prompt_tokens + num_outputs >= self.engines.max_model_len(
            job.model
        )

    async def _read_chunks(self, export: KVExport) -> AsyncIterator[KVChunk]:
        # Read off the engine thread: a kept request's blocks are immutable until `release` (it finished, so no
        # step writes them, and nothing else frees them), and release comes only after the push. The executor
        # keeps the event loop serving while the chunks are copied.
        # All chunks are read in one executor job: one thread hop instead of one per chunk.
        chunks = await asyncio.to_thread(lambda: list(export.chunks(max_bytes=self.max_chunk_bytes)))
        for chunk in chunks:
            yield chunk

    # -- the KV store ---------------------------------------------------------------------------------
    def _lookup(self, engine: AsyncEngine, job: PrefillJob) -> _Lookup | None:
        """The prompt's blocks and which of them the store may hold; None when the store is not used."""
        if self.store is None or not self.store.is_available() or not _is_valid_prompt(engine, job):
            return None
        block_size = self.engines.layout(job.model).block_size
        hashes = engine.prompt_block_hashes(
            job.prompt_token_ids, job.cache_salt, [image.key_span for image in job.images]
        )
        self.store.note_prompt(hashes, job.traffic_class)
        # The last prompt token is always computed (its logits give the first token), so its block never helps.
        hashes = hashes[: (len(job.prompt_token_ids) - 1) // block_size]
        return _Lookup(hashes, self.store.stored(hashes))

    def _decide(self, engine: AsyncEngine, job: PrefillJob, lookup: _Lookup, num_local: int) -> FetchDecision:
        """How many of the blocks the store holds after the engine's `num_local` to read (the rest is computed),
        on the request's span and in its result."""
        assert self.store is not None, "a lookup means a store"
        layout = self.engines.layout(job.model)
        after = lookup.block_hashes[num_local:]
        num_stored = len(after) if lookup.stored is None else _num_leading(lookup.stored[num_local:])
        decision = self.planner.decide(
            FetchQuestion(
                num_stored_blocks=num_stored,
                block_tokens=layout.block_size,
                block_bytes=layout.num_block_bytes,
                num_layers=layout.num_layers,
                num_new_tokens=len(job.prompt_token_ids) - num_local * layout.block_size,
                num_queued_tokens=engine.stats.num_queued_prompt_tokens,
                is_streamed=self.store.streams_layers(),
            )
        )
        current_span().set_attributes(decision.attributes())
        return decision

    async def _fetch_from_store(
        self, engine: AsyncEngine, job: PrefillJob, lookup: _Lookup, num_local: int, num_blocks: int
    ) -> _StoreHit | None:
        """Up to `num_blocks` blocks right after the `num_local` the engine holds that the store holds; None when
        there are none."""
        assert self.store is not None, "a lookup means a store"
        block_size = self.engines.layout(job.model).block_size
        hashes = lookup.block_hashes
        wanted = hashes[num_local : num_local + num_blocks]
        parent = hashes[num_local - 1] if num_local else root_hash(engine.served_name, job.cache_salt)
        stream = self.store.plan_stream(job.model, wanted)
        if stream is not None:
            count = len(stream.block_hashes)
            tokens = job.prompt_token_ids[num_local * block_size : (num_local + count) * block_size]
            return _StoreHit(parent, list(stream.block_hashes), tokens, [], num_local, stream)
        with span("kvmesh.kv.read store", attributes=_read_attributes("fetch", len(wanted))) as reading:
            began = time.monotonic()
            blocks = _usable_prefix(await self.store.fetch(job.model, wanted), wanted, self.engines.layout(job.model))
            num_bytes = sum(len(b.data) for b in blocks)
            reading.set_attributes({"kvmesh.kv.num_blocks": len(blocks), BYTES_MOVED: num_bytes})
        if blocks:
            self.planner.observe_read(num_bytes, time.monotonic() - began)
        if not blocks:
            return None
        tokens = job.prompt_token_ids[num_local * block_size : (num_local + len(blocks)) * block_size]
        return _StoreHit(parent, [b.block_hash for b in blocks], tokens, [b.data for b in blocks], num_local)


def first_token_params(params: SamplingParams, num_output_tokens: int = 0) -> SamplingParams:
    """The user's sampling for prefill's one token, after `num_output_tokens` a migrated generation already has:
    max_tokens one more (min_tokens capped to match: while the output is shorter than min_tokens, EOS and stop
    tokens are masked for this token exactly as the user's value does)."""
    limit = num_output_tokens + 1
    return dataclasses.replace(params, max_tokens=limit, min_tokens=min(params.min_tokens, limit))


def _read_attributes(mode: str, num_blocks_asked: int) -> dict[str, str | int]:
    return {"kvmesh.kv.read_mode": mode, "kvmesh.kv.num_blocks_asked": num_blocks_asked}


def _num_store_tokens(num_cached_tokens: int, hit: _StoreHit | None, num_injected: int, block_size: int) -> int:
    """The store's share of the engine's hit: what it found beyond the local blocks, at most what was injected."""
    if hit is None:
        return 0
    beyond_local = num_cached_tokens - hit.num_local_blocks * block_size
    return max(0, min(beyond_local, num_injected * block_size))


def _num_leading(flags: Sequence[bool]) -> int:
    """How many of the first flags are True."""
    return next((n for n, flag in enumerate(flags) if not flag), len(flags))


def _is_valid_prompt(engine: AsyncEngine, job: PrefillJob) -> bool:
    """Whether the prompt can be hashed and admitted; if not, skip the store and let the engine say why."""
    prompt = job.prompt_token_ids
    return 0 < len(prompt) < engine.max_model_len and all(0 <= t < engine.vocab_size for t in prompt)


def _usable_prefix(blocks: list[StoreBlock], wanted: list[bytes], layout: KVLayout) -> list[StoreBlock]:
    """The leading blocks that are the ones asked for and in this engine's layout (others cannot be used)."""
    usable = []
    for block, block_hash in zip(blocks, wanted, strict=False):  # the store may hold fewer
        if block.block_hash != block_hash or block.layout != layout:
            log.warning(
                "store block skipped",
                block_hash=block.block_hash.hex()[:16],
                reason="wrong key" if block.block_hash != block_hash else "layout mismatch",
            )
            break
        usable.append(block)
    return usable


async def _first_output(
    engine: AsyncEngine, request_id: str, outputs: asyncio.Queue[RequestOutput | BaseException]
) -> RequestOutput:
    # aclosing: leaving early (cancelled) aborts the request at once, inside follow (an async generator)
    follow = cast(AsyncGenerator[RequestOutput, None], engine.follow(request_id, outputs))
    async with contextlib.aclosing(follow) as stream:
        async for output in stream:
            if output.finished:
                if not output.new_token_ids:
                    raise EngineFailure(f"request {request_id!r} ended without a token ({output.finish_reason})")
                return output
    raise EngineFailure(f"request {request_id!r} produced no output")


def _settle(task: asyncio.Task[None] | asyncio.Task[DecodeTarget] | None) -> None:
    """A task beside the compute (the store stream: over by the first token, the last layer gates it; a binding:
    awaited by then), on any other way out stopped. A stopped store stream fails its load, so the engine never
    waits on it."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()  # retrieved, so a binding that failed after the compute had failed logs no "never retrieved"


def _is_next_step(engine: LLMEngine, num_tokens: int) -> bool:
    """On the engine thread, right after admitting a request of `num_tokens`: whether the next step computes it
    whole, its KV ready one step from now. Only when nothing else waits or runs (a prefill engine's running
    requests are prompts still in chunks) and the prompt fits one step's tokens; a prefix cache hit only shortens it."""
    scheduler = engine.scheduler
    return (
        len(scheduler.waiting) == 1 and not scheduler.running and num_tokens <= scheduler.config.max_num_batched_tokens
    )


def _discard(engine: LLMEngine, request_id: str) -> None:
    """Free the request whatever its state: abort if still running, release if kept after finishing."""
    engine.abort_request(request_id)
    engine.release(request_id)
