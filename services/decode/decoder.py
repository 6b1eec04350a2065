"""The decode role's core: take a request's KV pushed by prefill into the batch, then stream its tokens.

A request goes through three states here, each in one dict that only this object writes (on the event loop):
  importing  its KV is arriving (`receive`): blocks reserved, chunks being written;
  pushed     its KV is complete and it is decoding, but nobody follows it yet: its outputs queue up, and a
             timer aborts it if no follower comes within `attach_timeout_s`;
  following  a caller streams its tokens (`follow`); when the caller leaves, the request is aborted.
A request that leaves (finished, aborted, dropped) is reported to `on_left`: the finished-request feed that lets
balancers count its KV as free before the next heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from engine_core import LLMEngine, RequestOutput, SamplingParams
from engine_core.async_engine import AsyncEngine
from engine_core.kv_cache.manager import cdiv
from engine_core.kv_transfer import KVChunk, KVLayout, KVLayoutError
from engine_core.request import EmbeddingSpan, TokenLogprobs
from mesh.compute.engines import ModelEngines
from mesh.compute.errors import NoFreeBlocksError, UnknownRequestError
from mesh.compute.faults import Faults
from mesh.logging import get_logger

T = TypeVar("T")
log = get_logger(__name__)


@dataclass(frozen=True)
class PushHeader:
    """What prefill says about a request before its KV chunks (decode.proto KVPushHeader)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled by prefill: the first token
    params: SamplingParams  # the user's, not prefill's one-token version
    cache_salt: str | None
    layout: KVLayout
    num_tokens: int  # tokens whose KV follows (the prompt)
    num_blocks: int
    images: tuple[EmbeddingSpan, ...] = ()  # they key the request's blocks; a recompute after preemption needs them


@dataclass(frozen=True)
class TokenBatch:
    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # empty unless the request asked for logprobs
    finish_reason: str | None  # on the last batch: stop | length | abort
    num_output_tokens: int  # generated so far, prefill's first token included


@dataclass(frozen=True)
class LeftRequest:
    """A request that left this worker, its KV freed (events.proto RequestFinished)."""

    request_id: str
    model: str
    num_kv_tokens: int  # what it held when it left
    num_output_tokens: int  # prefill's first token included
    finish_reason: str  # stop | length | abort | dropped


@dataclass
class _Pushed:
    model: str
    outputs: asyncio.Queue[RequestOutput | BaseException]  # opened before decoding started: nothing is lost
    num_output_tokens: int  # tokens before decode's own (prefill's)
    num_kv_tokens: int  # tokens whose KV was pushed
    expiry: asyncio.TimerHandle  # aborts it unless a follower comes first


class Decoder:
    def __init__(
        self,
        engines: ModelEngines,
        attach_timeout_s: float,
        on_left: Callable[[LeftRequest], None] = lambda left: None,
        faults: Faults | None = None,
    ) -> None:
        self.engines = engines
        self.attach_timeout_s = attach_timeout_s
        self.on_left = on_left
        self.faults = faults or Faults()  # testing only (KVMESH_ALLOW_FAULT_INJECTION)
        # request id -> model / state; written only by this object, on the event loop
        self._importing: dict[str, str] = {}
        self._pushed: dict[str, _Pushed] = {}
        self._following: dict[str, str] = {}

    # -- PushKV ---------------------------------------------------------------------------------------
    async def receive(
        self,
        header: PushHeader,
        chunks: AsyncIterator[KVChunk],
        on_reserved: Callable[[], Awaitable[None]] | None = None,
    ) -> int:
        """Reserve blocks (then await `on_reserved`), write every chunk, start decoding; returns the KV bytes.

        Raises NoFreeBlocksError when the blocks are not free now. Any later failure (a bad chunk, a stream
        that ends early or breaks, cancellation) aborts the import and frees its blocks.
        """
        engine = self.engines.get(header.model)
        self._check_header(header)
        request_id = header.request_id
        self._importing[request_id] = header.model  # claimed before the first await: no duplicate slips in
        try:
            await engine.prepare_grammar(header.params)  # compiled before the request joins the batch
            # cancelled while waiting, the reservation still happens: the abort queued after it undoes it
            begun = await self._aborting_on_failure(
                engine,
                request_id,
                engine.call(
                    lambda e: e.begin_kv_import(
                        request_id,
                        header.prompt_token_ids,
                        header.output_token_ids,
                        header.params,
                        header.layout,
                        header.num_tokens,
                        cache_salt=header.cache_salt,
                        embeddings=header.images,
                    )
                ),
            )  # checks the layout against the engine's
            if not begun:
                raise NoFreeBlocksError("no free KV blocks")
            if on_reserved is not None:
                await self._aborting_on_failure(engine, request_id, on_reserved())
            num_bytes = await self._aborting_on_failure(engine, request_id, self._import(engine, header, chunks))
        finally:
            del self._importing[request_id]
        return num_bytes

    async def _import(self, engine: AsyncEngine, header: PushHeader, chunks: AsyncIterator[KVChunk]) -> int:
        """Write the chunks, check they were all there, and start decoding with the outputs queued."""
        request_id = header.request_id
        received = await self._receive_chunks(header, chunks)
        num_bytes = sum(len(chunk.data) for chunk in received)
        expected = header.layout.transfer_bytes(header.num_blocks, header.num_tokens)
        if num_bytes != expected:
            raise KVLayoutError(f"incomplete KV push: {num_bytes} of {expected} bytes arrived")
        outputs = engine.open_stream(request_id)  # before decoding starts, so no token is lost
        await engine.call(_import_all(request_id, received))
        expiry = asyncio.get_running_loop().call_later(self.attach_timeout_s, self._expire, request_id)
        self._pushed[request_id] = _Pushed(
            header.model, outputs, len(header.output_token_ids), header.num_tokens, expiry
        )
        return num_bytes

    @staticmethod
    async def _aborting_on_failure(engine: AsyncEngine, request_id: str, work: Awaitable[T]) -> T:
        """Await `work`; if it fails, abort the request (engine calls run in order, so after anything queued)."""
        try:
            return await work
        except BaseException:
            engine.close_stream(request_id)
            engine.call_soon(lambda e: e.abort_request(request_id))  # frees the blocks, importing or not
            raise

    def _check_header(self, header: PushHeader) -> None:
        if not header.request_id:
            raise ValueError("the push header has no request_id")
        if self._state_of(header.request_id) is not None:
            raise ValueError(f"duplicate request id {header.request_id!r}")
        expected_blocks = cdiv(header.num_tokens, header.layout.block_size) if header.layout.block_size > 0 else -1
        if header.num_blocks != expected_blocks:
            raise KVLayoutError(
                f"num_blocks {header.num_blocks} does not match {header.num_tokens} tokens "
                f"in blocks of {header.layout.block_size}"
            )

    @staticmethod
    async def _receive_chunks(header: PushHeader, chunks: AsyncIterator[KVChunk]) -> list[KVChunk]:
        """Every chunk of the push, size-checked. They are written to the cache in one engine call afterwards:
        on the engine thread (an Abort may free the blocks at any moment, and there a write can never land in a
        block already handed to another request), and at once (each call waits for a step boundary, so a call
        per chunk would cost a decode step per chunk under load)."""
        received = []
        layout = header.layout
        async for chunk in chunks:
            if len(chunk.data) != layout.transfer_chunk_bytes(chunk.layer, chunk.num_blocks, header.num_tokens):
                raise KVLayoutError(f"KV chunk of {len(chunk.data)} bytes does not hold {chunk.num_blocks} blocks")
            received.append(chunk)
        return received

    # -- Stream ---------------------------------------------------------------------------------------
    async def follow(self, request_id: str) -> AsyncIterator[TokenBatch]:
        """The request's tokens after prefill's, until it finishes. Leaving early aborts it (frees its KV)."""
        pushed = self._pushed.pop(request_id, None)
        if pushed is None:
            raise UnknownRequestError(f"no pushed request {request_id!r} waiting to be followed")
        pushed.expiry.cancel()
        self._following[request_id] = pushed.model
        num_output_tokens = pushed.num_output_tokens
        finish_reason = "abort"  # unless the engine says otherwise: the follower left, so it was aborted
        try:
            outputs = self.engines.get(pushed.model).follow(request_id, pushed.outputs)
            async with contextlib.aclosing(outputs):  # an injected fault aborts the request at once
                async for output in outputs:
                    if num_output_tokens == pushed.num_output_tokens:  # the request's first batch here
                        self.faults.check()
                    await self.faults.delay(len(output.new_token_ids))
                    num_output_tokens += len(output.new_token_ids)
                    finish_reason = output.finish_reason or finish_reason
                    yield TokenBatch(output.new_token_ids, output.new_logprobs, output.finish_reason, num_output_tokens)
        finally:
            del self._following[request_id]
            num_decoded = num_output_tokens - pushed.num_output_tokens
            self.on_left(
                LeftRequest(
                    request_id, pushed.model, pushed.num_kv_tokens + num_decoded, num_output_tokens, finish_reason
                )
            )

    # -- Abort ----------------------------------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Abort a request in any state; False if this worker does not hold it."""
        state = self._state_of(request_id)
        if state is None:
            return False
        if request_id in self._pushed:
            self._expire(request_id, reason="aborted")
            return True
        # importing: its push fails at the next chunk; following: its follower gets the abort as the last batch
        return await self.engines.get(state).call(lambda e: e.abort_request(request_id))

    def _expire(self, request_id: str, reason: str = "nobody followed it in time") -> None:
        pushed = self._pushed.pop(request_id, None)
        if pushed is None:
            return
        pushed.expiry.cancel()
        engine = self.engines.get(pushed.model)
        engine.close_stream(request_id)
        engine.call_soon(lambda e: e.abort_request(request_id))
        log.info("pushed request dropped", request_id=request_id, reason=reason)
        self.on_left(LeftRequest(request_id, pushed.model, pushed.num_kv_tokens, pushed.num_output_tokens, "dropped"))

    def _state_of(self, request_id: str) -> str | None:
        """The model of a request this worker holds, in any state."""
        if request_id in self._pushed:
            return self._pushed[request_id].model
        return self._importing.get(request_id) or self._following.get(request_id)

    def close(self) -> None:
        """Drop every request nobody follows (at shutdown)."""
        for request_id in list(self._pushed):
            self._expire(request_id, reason="shutting down")


def _import_all(request_id: str, chunks: list[KVChunk]) -> Callable[[LLMEngine], None]:
    """Write every chunk, then start decoding: one engine call."""

    def run(engine: LLMEngine) -> None:
        for chunk in chunks:
            engine.import_kv_chunk(request_id, chunk.layer, chunk.data, chunk.first_block)
        engine.finish_kv_import(request_id)

    return run
