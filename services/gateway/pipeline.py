"""One request's life in the mesh, after the front end has tokenized it:

1. block keys of the prompt (root: model + cache salt), for cache-aware routing;
2. Balancer.Route on a live balancer (the next one, within the same request, if it errs or cannot be reached:
   nothing has reached the client yet) -> a (prefill, decode) pair, or the prefill worker alone (late binding);
3. Prefill.PrefillStream: prefill answers with the first token as soon as it is sampled, then again once its push
   of the KV to the decode worker is done. With late binding the first answer names the decode worker, which
   prefill asked a balancer for (Balancer.BindDecode) when the KV was ready; the decode workers to avoid go with
   the request (`exclude_decode_worker_ids`). On UNAVAILABLE or RESOURCE_EXHAUSTED before the first answer the
   failed worker (prefill's `kvmesh-failed-worker` trailer names a failed decode worker; without it, the prefill
   worker failed) is excluded and the request re-routed, up to max_retries;
4. Decode.Stream: the remaining tokens, detokenized as they come, cut at a stop string (then the call is
   cancelled, which makes decode abort the request and free its KV). A failure after the first token migrates the
   generation to another pair (GenerationStream), and so does a decode worker out of routing (slow, or failing its
   health checks) whose next token, or prefill's push to it, is overdue. The gaps between the tokens are the mesh
   view's samples of each decode worker's inter-token latency (mesh/latency_outliers.py); a slow worker is left
   out of the routes (`exclude_worker_ids`).

`Pipeline.start` does 1-3 and returns a GenerationStream once the first token is known, so the front end
knows the serving workers before it sends a byte. The stream's owner must `close()` it (in a finally):
that cancels a decode stream still running, or aborts a request decode holds but nobody followed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from engine_core.kv_cache.block_hash import hash_token_blocks, root_hash
from mesh import rpc, tracing
from mesh.logging import get_logger
from mesh.metrics import GATEWAY_MIGRATIONS
from mesh.pb import (
    balancer_pb2,
    balancer_pb2_grpc,
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    encoder_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.gateway.catalog import ServedModel
from services.gateway.detokenizer import Detokenizer
from services.gateway.errors import ErrorKind, GatewayError, from_rpc_error
from services.gateway.image_encoding import key_spans
from services.gateway.mesh_view import MeshView

log = get_logger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
NOT_FINISHED = common_pb2.FINISH_REASON_UNSPECIFIED
STALL_CHECK_S = 0.1  # how often a stream waiting for its next token looks whether its decode worker was ejected


@dataclass(frozen=True)
class Generation:
    """What a front end asks of the mesh (built by http_app or grpc_api, after validation)."""

    request_id: str
    model: ServedModel
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    stop: tuple[str, ...] = ()
    cache_salt: str = ""
    traffic_class: str = ""
    images: tuple[encoder_pb2.PromptImage, ...] = ()  # embeddings at the prompt's image placeholders (image_encoding)
    output_token_ids: tuple[int, ...] = ()  # a migrated generation's output so far: prefill goes on after it
    # The prompt's block keys, hashed with its tokens on a tokenizer thread (chat.py) and shared by the n choices;
    # None: `Pipeline.attempt` hashes them on the event loop (a prompt with images, widened after rendering).
    block_keys: tuple[bytes, ...] | None = None


@dataclass(frozen=True)
class Placement:
    """Where a started generation runs."""

    request_id: str  # the id the workers know this attempt by (the request id, suffixed on a retry)
    prefill_worker: str
    decode_worker: str
    decode_address: str


@dataclass(frozen=True)
class Attempt:
    """A routed and prefilled attempt: its workers, prefill's first answer, and the call still delivering the
    second (decode holds the KV)."""

    placement: Placement
    first: prefill_pb2.PrefillResponse
    prefill_call: grpc.aio.UnaryStreamCall


@dataclass(frozen=True)
class Delta:
    text: str  # new text since the last delta (maybe "" while a character or a possible stop is held back)
    token_ids: list[int]  # the tokens it came from (none after a stop string)
    finish_reason: int  # common_pb2.FinishReason: STOP or LENGTH on the last delta, else UNSPECIFIED
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # one per token, when asked for


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s

    def remaining(self, cap: float | None = None) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise GatewayError(ErrorKind.TIMEOUT, "the request took longer than this server allows")
        return left if cap is None else min(left, cap)


def failed_worker(error: grpc.aio.AioRpcError, prefill_worker: str) -> str:
    for key, value in error.trailing_metadata() or ():
        if key == rpc.FAILED_WORKER_KEY and value:
            return str(value)
    return prefill_worker


class DecodeStalled(Exception):
    """The stream's decode worker is out of routing and its next token overdue: the generation migrates."""


class Pipeline:
    def __init__(self, channels: rpc.Channels, mesh: MeshView, block_size: int, max_retries: int) -> None:
        self.channels = channels
        self.mesh = mesh
        self.block_size = block_size
        self.max_retries = max_retries
        self._aborts: set[asyncio.Task[None]] = set()  # fire-and-forget Decode.Abort calls, held until done

    async def start(self, generation: Generation, deadline: Deadline) -> GenerationStream:
        """Route and prefill (re-routing around failed workers): a stream whose first token is known."""
        return GenerationStream(self, generation, await self.attempt(generation, deadline), deadline)

    async def attempt(self, generation: Generation, deadline: Deadline, excluded: Sequence[str] = ()) -> Attempt:
        """Route and prefill until the first token is known, re-routing around failed workers (and `excluded`)."""
        block_hashes = generation.block_keys
        if block_hashes is None:
            block_hashes = tuple(
                self.block_keys(
                    generation.model.name, generation.prompt_token_ids, generation.cache_salt, generation.images
                )
            )
        excluded = list(excluded)
        last_error: grpc.aio.AioRpcError | None = None
        for attempt in range(self.max_retries + 1):
            attempt_id = generation.request_id if attempt == 0 else f"{generation.request_id}.{attempt}"
            avoided = self._avoided(generation, excluded)
            try:
                route = await self._route(generation, attempt_id, block_hashes, avoided, deadline)
            except GatewayError:
                if last_error is None:
                    raise
                raise from_rpc_error(last_error, "prefill") from None  # nothing left to try: say why
            call = self._prefill(generation, attempt_id, route, avoided, deadline)
            try:
                first = await call.read()
                if first is grpc.aio.EOF:  # a servicer that ends without answering: treat as unavailable
                    raise GatewayError(ErrorKind.UNAVAILABLE, "the prefill worker answered nothing; retry shortly")
            except grpc.aio.AioRpcError as error:
                failed = failed_worker(error, route.prefill.worker_id)
                log.warning(
                    "prefill failed",
                    prefill_worker=route.prefill.worker_id,
                    failed_worker=failed,
                    code=error.code().name,
                    details=error.details(),
                    attempt=attempt,
                )
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    self.mesh.report_failure(failed)
                if error.code() not in RETRYABLE or attempt == self.max_retries:
                    raise from_rpc_error(error, "prefill") from None
                excluded.append(failed)
                last_error = error
                continue
            except asyncio.CancelledError:  # the client left mid-prefill: decode may already hold the KV
                call.cancel()
                if route.decode.address:  # late binding: cancelling prefill's push makes decode free the KV
                    self.abort_later(route.decode.address, attempt_id)
                raise
            if route.HasField("decode"):
                decode_worker, decode_address = route.decode.worker_id, route.decode.address
            else:  # late binding: prefill's first answer names the decode worker it bound
                decode_worker, decode_address = first.decode_worker_id, first.decode_address
            placement = Placement(attempt_id, route.prefill.worker_id, decode_worker, decode_address)
            return Attempt(placement, first, call)
        raise AssertionError("unreachable: the last attempt raises")

    def block_keys(
        self,
        model: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str = "",
        images: Sequence[encoder_pb2.PromptImage] = (),
    ) -> list[bytes]:
        """The prompt's chained block keys, hashed by the block size the model's workers report (the gateway's
        `block_size` until one does), so they equal the keys of the blocks those workers cache. When the
        workers disagree: no keys, so the balancer routes by load alone."""
        return self.key_hasher(model, cache_salt, images)(prompt_token_ids)

    def key_hasher(
        self, model: str, cache_salt: str = "", images: Sequence[encoder_pb2.PromptImage] = ()
    ) -> Callable[[Sequence[int]], list[bytes]]:
        """`block_keys` split in two: the block size is read here, on the event loop (the mesh view's one reader
        thread); the function returned only hashes, so the tokenizer thread that made the prompt can run it in
        the same hand-off (a 2,000-token prompt is about 0.7 ms of hashing the loop no longer does)."""
        block_size = self.mesh.block_size(model, self.block_size)
        if block_size is None:
            return lambda prompt_token_ids: []
        root = root_hash(model, cache_salt or None)
        return functools.partial(hash_token_blocks, root, block_size=block_size, key_spans=key_spans(images))

    def _avoided(self, generation: Generation, excluded: Sequence[str]) -> list[str]:
        """The workers this attempt avoids: those that failed it, and the decode workers too slow to route to."""
        slow = self.mesh.slow_decode_ids(generation.model.name, excluded)
        if slow:
            tracing.current_span().set_attribute("kvmesh.slow_decode_excluded", slow)
        return [*excluded, *slow]

    async def _route(
        self,
        generation: Generation,
        attempt_id: str,
        block_hashes: Sequence[bytes],
        avoided: Sequence[str],
        deadline: Deadline,
    ) -> balancer_pb2.RouteResponse:
        request = balancer_pb2.RouteRequest(
            request_id=attempt_id,
            model=generation.model.name,
            block_hashes=block_hashes,
            num_prompt_tokens=len(generation.prompt_token_ids) + len(generation.output_token_ids),
            traffic_class=generation.traffic_class,
            exclude_worker_ids=avoided,
        )
        for balancer in self.mesh.balancers():
            stub = balancer_pb2_grpc.BalancerStub(self.channels.get(balancer.info.address))
            try:
                response: balancer_pb2.RouteResponse = await stub.Route(
                    request, timeout=deadline.remaining(rpc.ROUTE_TIMEOUT_S), metadata=rpc.metadata(attempt_id)
                )
                return response
            except grpc.aio.AioRpcError as error:
                log.warning(
                    "route failed", balancer=balancer.worker_id, code=error.code().name, details=error.details()
                )
                # not reported towards its ejection: a balancer also answers UNAVAILABLE when it has no worker
                # to offer; the health checks eject a dead one (mesh.health)
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT:  # any balancer would say the same
                    raise from_rpc_error(error, "balancer") from None
        raise GatewayError(
            ErrorKind.UNAVAILABLE, f"no worker is available to serve {generation.model.name!r}; retry shortly"
        )

    def _prefill(
        self,
        generation: Generation,
        attempt_id: str,
        route: balancer_pb2.RouteResponse,
        avoided: Sequence[str],
        deadline: Deadline,
    ) -> grpc.aio.UnaryStreamCall:
        request = prefill_pb2.PrefillRequest(
            request_id=attempt_id,
            model=generation.model.name,
            prompt_token_ids=generation.prompt_token_ids,
            sampling=generation.sampling,
            cache_salt=generation.cache_salt,
            traffic_class=generation.traffic_class,
            decode_address=route.decode.address,
            decode_worker_id=route.decode.worker_id,
            decode_data_address=route.decode.data_address,
            images=generation.images,
            output_token_ids=generation.output_token_ids,
            exclude_decode_worker_ids=avoided if not route.HasField("decode") else (),
            canary=route.canary,
        )
        stub = prefill_pb2_grpc.PrefillStub(self.channels.get(route.prefill.address))
        call: grpc.aio.UnaryStreamCall = stub.PrefillStream(
            request, timeout=deadline.remaining(rpc.PREFILL_TIMEOUT_S), metadata=rpc.metadata(attempt_id)
        )
        return call

    def open_decode_stream(self, placement: Placement, deadline: Deadline) -> grpc.aio.UnaryStreamCall:
        stub = decode_pb2_grpc.DecodeStub(self.channels.get(placement.decode_address))
        call: grpc.aio.UnaryStreamCall = stub.Stream(
            decode_pb2.StreamRequest(request_id=placement.request_id),
            timeout=deadline.remaining(),
            metadata=rpc.metadata(placement.request_id),
        )
        return call

    def abort_later(self, decode_address: str, request_id: str) -> None:
        """Tell decode to drop a request nobody will follow (best effort; decode also times such out)."""
        task = asyncio.get_running_loop().create_task(self._abort(decode_address, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, decode_address: str, request_id: str) -> None:
        stub = decode_pb2_grpc.DecodeStub(self.channels.get(decode_address))
        try:
            await stub.Abort(
                decode_pb2.AbortRequest(request_id=request_id),
                timeout=rpc.ABORT_TIMEOUT_S,
                metadata=rpc.metadata(request_id),
            )
        except grpc.aio.AioRpcError as error:
            log.info("abort failed", request_id=request_id, code=error.code().name)


class GenerationStream:
    """A started generation. Only `deltas()` writes the counters; front ends read them.

    The first token goes out as soon as prefill samples it, while the KV is still on its way to decode. When the
    decode side fails after that (the push failed, the worker died or aborted the request), the generation
    migrates, as Dynamo's request migration does: the prompt and the tokens already sent are prefilled on another
    (prefill, decode) pair, excluding the failed worker, and the output goes on where it stopped. The tokens sent
    go as output, not prompt (`PrefillRequest.output_token_ids`), so the engine there continues the generation
    itself: max_tokens and min_tokens count them, penalties see them, a seeded request draws the same tokens
    (its draws depend on the seed and the output position), and a grammar's matcher advances over them. The
    output is the one an uninterrupted run gives.
    """

    def __init__(self, pipeline: Pipeline, generation: Generation, attempt: Attempt, deadline: Deadline) -> None:
        self.placement = attempt.placement
        self.num_prompt_tokens = len(generation.prompt_token_ids)
        self.num_cached_tokens = attempt.first.num_cached_tokens
        self.prefill_seconds = attempt.first.prefill_seconds  # the prefill engine's own time, for overhead accounting
        self.num_completion_tokens = 0
        self.num_migrations = 0
        self.finish_reason: int = NOT_FINISHED  # common_pb2.FinishReason
        self._pipeline = pipeline
        self._generation = generation
        self._attempt = attempt
        self._deadline = deadline
        self._detokenizer = Detokenizer(generation.model.tokenizer, generation.prompt_token_ids, generation.stop)
        self._token_ids: list[int] = []  # every output token so far: a migration's prompt continues with them
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._is_held_by_decode = attempt.first.finish_reason == NOT_FINISHED  # decode holds the KV until it finishes

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)

    async def deltas(self) -> AsyncIterator[Delta]:
        """The output, batch by batch, until a finish reason (raises GatewayError if the workers fail for good)."""
        while True:
            attempt = self._attempt
            first = attempt.first
            first_logprobs = [first.first_logprob] if first.HasField("first_logprob") else []
            delta = self._accept([first.first_token_id], first.finish_reason, first_logprobs)
            if self.num_migrations == 0 or delta.text or delta.finish_reason != NOT_FINISHED:
                yield delta
            if self.finish_reason != NOT_FINISHED:
                return
            failed = attempt.placement.decode_worker
            why = "the decode worker ended the stream before the request finished"
            cause = "failed"
            try:
                await self._wait_for_push(attempt)
                self._call = self._pipeline.open_decode_stream(attempt.placement, self._deadline)
                async for batch in self._batches(self._call, attempt.placement.decode_worker):
                    if batch.finish_reason == common_pb2.FINISH_REASON_ABORT:
                        why = "the decode worker aborted the request"
                        break
                    if batch.finish_reason != NOT_FINISHED:
                        self._is_held_by_decode = False
                    delta = self._accept(batch.token_ids, batch.finish_reason, batch.logprobs)
                    if delta.text or delta.finish_reason != NOT_FINISHED:
                        yield delta
                    if self.finish_reason != NOT_FINISHED:
                        return
            except grpc.aio.AioRpcError as error:
                failed = failed_worker(error, attempt.placement.decode_worker)
                log.warning(
                    "decode side failed",
                    decode_worker=attempt.placement.decode_worker,
                    failed_worker=failed,
                    code=error.code().name,
                    details=error.details(),
                )
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    self._pipeline.mesh.report_failure(failed)
                if error.code() not in RETRYABLE:
                    raise from_rpc_error(error, "decode") from None
                why = f"the {'decode' if failed == attempt.placement.decode_worker else 'prefill'} worker failed"
            except DecodeStalled as stalled:
                why, cause = str(stalled), "slow"
            finally:
                if self._call is not None:
                    self._call.cancel()  # a no-op once decode ended it; after a stop string, decode aborts the request
            await self._migrate(failed, why, cause)

    async def _batches(
        self, call: grpc.aio.UnaryStreamCall, decode_worker: str
    ) -> AsyncIterator[decode_pb2.TokenBatch]:
        """Decode's token batches as they arrive. The gap before each (after the first) is an inter-token latency
        sample of `decode_worker` (MeshView.record_token_gap). While the worker is out of routing (slow, or failing
        its checks) and a migration is left, waiting longer than MeshView.stall_limit_s for the next token raises
        DecodeStalled: the output goes on on another pair rather than at the slow worker's pace."""
        mesh, model = self._pipeline.mesh, self._generation.model.name
        if not mesh.watches_stalls:
            async for batch in call:
                yield batch
            return
        last_s: float | None = None  # the previous batch's arrival
        waiting_since_s = time.monotonic()
        while True:
            batch = await self._read(call, decode_worker, waiting_since_s)
            if batch is grpc.aio.EOF:
                return
            now_s = time.monotonic()
            if last_s is not None and batch.token_ids:
                mesh.record_token_gap(model, decode_worker, now_s - last_s, len(batch.token_ids))
            last_s = waiting_since_s = now_s
            yield batch

    async def _read(self, call: grpc.aio.UnaryStreamCall, decode_worker: str, waiting_since_s: float) -> Any:
        """The call's next message, or EOF; raises DecodeStalled as `_check_stall` says."""
        read = asyncio.ensure_future(call.read())
        try:
            while not read.done():
                await asyncio.wait({read}, timeout=STALL_CHECK_S)
                self._check_stall(read, decode_worker, time.monotonic() - waiting_since_s)
        finally:
            read.cancel()  # a no-op once done; else (this task cancelled, or a stall) cancels the call
        return read.result()

    def _check_stall(self, read: asyncio.Future[object], decode_worker: str, waited_s: float) -> None:
        """Raise DecodeStalled if the stream should leave `decode_worker` now (see `_batches`)."""
        if read.done() or self.num_migrations >= self._pipeline.max_retries:  # slow is better than failed
            return
        limit_s = self._pipeline.mesh.stall_limit_s(self._generation.model.name, decode_worker)
        if limit_s is not None and waited_s > limit_s:
            raise DecodeStalled(
                f"the decode worker is out of routing (slow, failing its checks, or gone): no token for "
                f"{waited_s * 1000:.0f} ms, over its stall limit of {limit_s * 1000:.0f} ms"
            )

    async def _wait_for_push(self, attempt: Attempt) -> None:
        """Prefill's second answer: decode holds the KV (raises AioRpcError when the push failed). A push to a
        decode worker out of routing (slow, or failing its checks: stopped, starved) that outlasts the stall limit
        raises DecodeStalled, as a late token does: the request moves rather than wait for that worker."""
        decode_worker, since_s = attempt.placement.decode_worker, time.monotonic()
        while await self._read(attempt.prefill_call, decode_worker, since_s) is not grpc.aio.EOF:
            pass

    async def _migrate(self, failed: str, why: str, cause: str) -> None:
        """Go on on another pair: prefill the prompt plus the output so far (raises GatewayError when it may not).
        `cause`: failed or slow (the migrations metric's reason)."""
        generation = self._generation
        self.close()
        if self.num_migrations >= self._pipeline.max_retries:
            raise GatewayError(ErrorKind.UNAVAILABLE, f"{why}; retry shortly")
        self.num_migrations += 1
        GATEWAY_MIGRATIONS.labels(cause).inc()
        resumed = dataclasses.replace(
            generation,
            request_id=f"{generation.request_id}.m{self.num_migrations}",
            output_token_ids=tuple(self._token_ids),
        )
        log.warning(
            "migrating a generation",
            reason=why,
            failed_worker=failed,
            num_output_tokens=self.num_completion_tokens,
            migration=self.num_migrations,
        )
        attributes = {
            "kvmesh.failed_worker_id": failed,
            "kvmesh.reason": why,
            "kvmesh.migration": self.num_migrations,
            "kvmesh.migration_cause": cause,
        }
        with tracing.span("kvmesh.migrate", attributes=attributes):
            self._attempt = await self._pipeline.attempt(resumed, self._deadline, excluded=[failed])
        self.placement = self._attempt.placement
        self._is_held_by_decode = self._attempt.first.finish_reason == NOT_FINISHED

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._detokenizer.stop_string

    def _accept(
        self, token_ids: Sequence[int], finish_reason: int, logprobs: Sequence[common_pb2.TokenLogprob] = ()
    ) -> Delta:
        if finish_reason == common_pb2.FINISH_REASON_ABORT:
            raise GatewayError(ErrorKind.UNAVAILABLE, "the worker aborted the request; retry shortly")
        texts, accepted = [], []
        for token_id in token_ids:
            accepted.append(token_id)
            texts.append(self._detokenizer.push(token_id))
            if self._detokenizer.is_stopped:
                break
        if finish_reason != NOT_FINISHED and not self._detokenizer.is_stopped:
            texts.append(self._detokenizer.finish())
        if self._detokenizer.is_stopped:
            finish_reason = common_pb2.FINISH_REASON_STOP
        self.num_completion_tokens += len(accepted)
        self._token_ids += accepted
        self.finish_reason = finish_reason
        return Delta("".join(texts), accepted, finish_reason, list(logprobs[: len(accepted)]))

    def close(self) -> None:
        """Free what the workers hold for an unfinished generation. Safe to call twice. Cancelling the stream
        makes decode abort the request, but a call cancelled before decode saw it tells decode nothing, so an
        unfinished request also gets an explicit Abort (idempotent)."""
        if self._call is not None and not self._call.done():
            self._call.cancel()
        self._attempt.prefill_call.cancel()  # a no-op once prefill answered twice
        if self._is_held_by_decode:
            self._pipeline.abort_later(self.placement.decode_address, self.placement.request_id)
            self._is_held_by_decode = False
