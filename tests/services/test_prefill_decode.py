"""Prefill and decode as real gRPC services on loopback with a real NATS: the KV handoff gives exactly the
tokens of one engine, failures get their status codes, and the KV store path reads and writes blocks.

The workers run in this process (their `start()`/`stop()` are what `serve()` runs), on one module-wide loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from engine_core import SamplingParams
from engine_core.kv_cache.block_hash import root_hash
from engine_core.kv_cache.manager import cdiv
from engine_core.kv_transfer import KVLayout
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import rpc, subjects
from mesh.bus import Bus
from mesh.compute.convert import layout_to_proto, sampling_to_proto
from mesh.config import SettingError, load_settings
from mesh.discovery import Announcer
from mesh.pb import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    events_pb2,
    kvcache_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from mesh.placement import rendezvous_owner
from services.decode.config import DecodeSettings
from services.decode.server import DecodeService
from services.prefill.config import PrefillSettings
from services.prefill.prefiller import StoreBlock
from services.prefill.server import PrefillService
from services.prefill.store_client import StoreWriter, stored_prefix_length

from .pd_harness import DictKVCache, reference_outputs, scrape, start_store_node, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

HEARTBEAT_S = 0.2
LLAMA_BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block * kv heads * head size * fp32
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 490, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Mesh:
    prefill: PrefillService
    decode: DecodeService
    small_decode: DecodeService  # llama only, 8 blocks: easy to fill
    stores: dict[str, DictKVCache]  # worker id -> its blocks
    prefill_stub: prefill_pb2_grpc.PrefillStub
    decode_stub: decode_pb2_grpc.DecodeStub
    small_decode_stub: decode_pb2_grpc.DecodeStub
    channels: rpc.Channels
    llama: str
    deepseek: str
    nats_url: str

    def request(
        self,
        request_id: str,
        model: str,
        prompt: list[int],
        params: SamplingParams,
        decode: DecodeService | None = None,
        **fields: object,
    ) -> prefill_pb2.PrefillRequest:
        decode = decode or self.decode
        values: dict = dict(
            request_id=request_id,
            model=model,
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(params),
            decode_address=decode.runtime.address,
            decode_worker_id=decode.runtime.worker_id,
            decode_data_address=decode.runtime.data_address,
        )  # pushes go over the bulk lane
        return prefill_pb2.PrefillRequest(**{**values, **fields})


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as nats:
        yield nats.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(nats_url, llama_reference, deepseek_reference) -> AsyncIterator[Mesh]:
    llama, deepseek = str(llama_reference[0]), str(deepseek_reference[0])
    common = dict(
        nats_url=nats_url,
        heartbeat_interval_s=HEARTBEAT_S,
        log_level="warning",
        drain_timeout_s=5.0,
        models=(llama, deepseek),
        kv_cache_memory_bytes=2 * 2**20,
    )
    store_nodes = [await start_store_node(nats_url, f"kvcache-{i}") for i in range(2)]
    decode = await DecodeService.start(load_settings(DecodeSettings, env={}, worker_id="decode-t", **common))
    small_decode = await DecodeService.start(
        load_settings(
            DecodeSettings,
            env={},
            **{**common, "models": (llama,), "kv_cache_memory_bytes": 8 * LLAMA_BLOCK_BYTES},
            worker_id="decode-small",
        )
    )
    # the store double publishes no KV events, so prefill probes it (Lookup) instead of reading the global index
    prefill = await PrefillService.start(
        load_settings(PrefillSettings, env={}, worker_id="prefill-t", kv_index_enabled=False, **common)
    )
    assert prefill.registry is not None
    await wait_until(lambda: len(prefill.registry.workers()) == 2, what="prefill to hear both store nodes")
    assert prefill.writer is not None
    await wait_until(lambda: prefill.writer.is_accepting, what="prefill to start writing to the store")
    channels = rpc.Channels()
    yield Mesh(
        prefill,
        decode,
        small_decode,
        {r.worker_id: s for r, s in store_nodes},
        prefill_pb2_grpc.PrefillStub(channels.get(prefill.runtime.address)),
        decode_pb2_grpc.DecodeStub(channels.get(decode.runtime.address)),
        decode_pb2_grpc.DecodeStub(channels.get(small_decode.runtime.address)),
        channels,
        llama,
        deepseek,
        nats_url,
    )
    await channels.close()
    for service in (prefill, decode, small_decode):
        await service.stop()
    for runtime, _ in store_nodes:
        await runtime.shutdown()


async def engine_stats(service: PrefillService | DecodeService, model: str):
    assert service.engines is not None
    return await service.engines.get(model).call(lambda e: e.stats())


async def wait_for_free_blocks(service: PrefillService | DecodeService, model: str) -> None:
    """Every block of the model's engine free again (cached blocks count as free) and nothing running."""
    for _ in range(200):
        stats = await engine_stats(service, model)
        if stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks still held: {stats}")


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def trailing(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {key: value for key, value in error.trailing_metadata() or ()}


async def next_heartbeat(
    nats_url: str, role: str, worker_id: str, condition: Callable[[events_pb2.WorkerHeartbeat], bool]
) -> events_pb2.WorkerHeartbeat:
    """The first heartbeat of the worker that meets the condition."""
    found: asyncio.Future[events_pb2.WorkerHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_beat(beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        if beat.worker.worker_id == worker_id and condition(beat) and not found.done():
            found.set_result(beat)

    bus = await Bus.connect(nats_url, "test-heartbeats")
    try:
        await bus.subscribe(subjects.heartbeat(role), events_pb2.WorkerHeartbeat, on_beat)
        return await asyncio.wait_for(found, 5.0)
    finally:
        await bus.close()


class StalledDecode(decode_pb2_grpc.DecodeServicer):
    """A decode worker that takes the whole push and then never answers."""

    def __init__(self) -> None:
        self.num_messages = 0
        self.cancelled = asyncio.Event()

    async def PushKV(self, request_iterator, context):
        await context.send_initial_metadata(((rpc.KV_RESERVED_KEY, "1"),))
        try:
            async for _ in request_iterator:
                self.num_messages += 1
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


# -- the handoff --------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["llama", "deepseek"])
async def test_a_handoff_streams_exactly_the_tokens_of_one_engine(mesh: Mesh, which: str):
    model = getattr(mesh, which)
    prompt = prompt_of(37, seed=1)
    params = dataclasses.replace(GREEDY, logprobs=2)
    expected, expected_logprobs = reference_outputs(model, prompt, params)

    def moved() -> float:
        return metric("kvmesh_kv_transfer_bytes_total", direction="prefill_to_decode")

    moved_before = moved()
    response = await mesh.prefill_stub.Prefill(mesh.request(f"handoff-{which}", model, prompt, params))
    assert response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert moved() == moved_before + 2 * response.kv_bytes_sent  # both ends count, into this process's registry
    assert (response.worker_id, response.num_prompt_tokens, response.num_cached_tokens) == ("prefill-t", 37, 0)
    layout = mesh.decode.engines.layout(model)
    assert response.kv_bytes_sent == layout.num_layers * layout.chunk_bytes(cdiv(37, 16))  # the exported size
    batches = [b async for b in mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id=f"handoff-{which}"))]
    tokens = [response.first_token_id] + [t for b in batches for t in b.token_ids]
    assert tokens == expected
    assert [b.num_output_tokens for b in batches] == list(range(2, 11))
    assert [b.finish_reason for b in batches] == [0] * 8 + [common_pb2.FINISH_REASON_LENGTH]
    logprobs = [response.first_logprob] + [lp for b in batches for lp in b.logprobs]
    assert [(lp.token_id, lp.rank, len(lp.top_token_ids)) for lp in logprobs] == [
        (lp.token_id, lp.rank, 2) for lp in expected_logprobs
    ]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in expected_logprobs], abs=1e-4)

    stats = await engine_stats(mesh.decode, model)
    assert stats.num_prompt_tokens_computed == 0 and stats.num_generated_tokens >= 9  # decode never recomputed
    await wait_for_free_blocks(mesh.decode, model)
    await wait_for_free_blocks(mesh.prefill, model)  # the kept request was released
    await asyncio.sleep(2 * HEARTBEAT_S)  # decode exports its gauges every heartbeat interval
    # the endpoint is served by this very loop: scrape from a thread
    samples = await asyncio.to_thread(scrape, mesh.decode.runtime.http_port, "kvmesh_decode_prompt_tokens_computed")
    assert samples[f'{{model="{model}"}}'] == 0


async def test_a_first_token_that_ends_the_request_pushes_nothing(mesh: Mesh):
    prompt = prompt_of(30, seed=2)
    expected, _ = reference_outputs(mesh.llama, prompt, GREEDY)
    nowhere = dict(
        decode_address=f"127.0.0.1:{free_port()}",
        decode_worker_id="decode-nowhere",
        decode_data_address=f"127.0.0.1:{free_port()}",
    )
    one = await mesh.prefill_stub.Prefill(
        mesh.request("one-token", mesh.llama, prompt, dataclasses.replace(GREEDY, max_tokens=1), **nowhere)
    )
    assert (one.first_token_id, one.finish_reason, one.kv_bytes_sent) == (
        expected[0],
        common_pb2.FINISH_REASON_LENGTH,
        0,
    )
    stop = await mesh.prefill_stub.Prefill(
        mesh.request(
            "stop-token",
            mesh.llama,
            prompt,
            dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=[expected[0]]),
            **nowhere,
        )
    )
    assert (stop.first_token_id, stop.finish_reason, stop.kv_bytes_sent) == (
        expected[0],
        common_pb2.FINISH_REASON_STOP,
        0,
    )
    assert stop.num_cached_tokens == 16  # the first request left its full block in the device cache
    await wait_for_free_blocks(mesh.prefill, mesh.llama)


async def test_a_cancelled_stream_frees_decode_blocks(mesh: Mesh):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    await mesh.prefill_stub.Prefill(mesh.request("cancelled", mesh.deepseek, prompt_of(40, seed=3), params))
    call = mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="cancelled"))
    assert len((await call.read()).token_ids) == 1
    assert (await engine_stats(mesh.decode, mesh.deepseek)).num_running == 1
    call.cancel()
    await wait_for_free_blocks(mesh.decode, mesh.deepseek)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="cancelled")).read()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


LONG = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)  # seconds of decoding


async def test_abort_ends_a_followed_stream(mesh: Mesh):
    await mesh.prefill_stub.Prefill(mesh.request("followed", mesh.deepseek, prompt_of(20, seed=9), LONG))
    call = mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="followed"))
    await call.read()
    beat = await next_heartbeat(mesh.nats_url, "decode", "decode-t", lambda b: b.load.num_running == 1)
    assert beat.load.num_kv_tokens >= 21 and 0 < beat.load.kv_usage < 1
    assert (await mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="followed"))).aborted
    batches = []
    while (batch := await call.read()) is not grpc.aio.EOF:
        batches.append(batch)
    assert batches[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    await wait_for_free_blocks(mesh.decode, mesh.deepseek)


async def test_abort_frees_a_pushed_request(mesh: Mesh):
    await mesh.prefill_stub.Prefill(mesh.request("to-abort", mesh.llama, prompt_of(20, seed=4), LONG))
    assert (await engine_stats(mesh.decode, mesh.llama)).num_running == 1
    assert (await mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="to-abort"))).aborted
    assert not (await mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="to-abort"))).aborted
    await wait_for_free_blocks(mesh.decode, mesh.llama)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="to-abort")).read()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_request_nobody_follows_is_aborted_after_the_attach_timeout(mesh: Mesh, monkeypatch):
    monkeypatch.setattr(mesh.decode.decoder, "attach_timeout_s", 0.3)  # KVMESH_STREAM_ATTACH_TIMEOUT_S
    generated = (await engine_stats(mesh.decode, mesh.llama)).num_generated_tokens
    await mesh.prefill_stub.Prefill(mesh.request("unfollowed", mesh.llama, prompt_of(20, seed=8), LONG))
    assert (await engine_stats(mesh.decode, mesh.llama)).num_running == 1
    await wait_for_free_blocks(mesh.decode, mesh.llama)
    # aborted after 0.3 s, long before its 900 tokens
    assert (await engine_stats(mesh.decode, mesh.llama)).num_generated_tokens - generated < 899
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="unfollowed")).read()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_every_request_leaving_decode_is_announced_with_its_kv_and_length(mesh: Mesh, monkeypatch):
    heard: dict[str, events_pb2.RequestFinished] = {}

    async def on_finished(message: events_pb2.RequestFinished, subject: str) -> None:
        heard[message.request_id] = message

    bus = await Bus.connect(mesh.nats_url, "test-finished")
    await bus.subscribe(subjects.REQUESTS_FINISHED, events_pb2.RequestFinished, on_finished)
    try:
        # finished: 25 prompt tokens pushed, 9 decoded after prefill's first token
        await mesh.prefill_stub.Prefill(mesh.request("left-done", mesh.llama, prompt_of(25, seed=11), GREEDY))
        assert len([b async for b in mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="left-done"))]) == 9
        # aborted while followed
        await mesh.prefill_stub.Prefill(mesh.request("left-abort", mesh.llama, prompt_of(20, seed=12), LONG))
        call = mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="left-abort"))
        await call.read()
        assert (await mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="left-abort"))).aborted
        while await call.read() is not grpc.aio.EOF:
            pass
        # never followed: dropped at the attach timeout
        monkeypatch.setattr(mesh.decode.decoder, "attach_timeout_s", 0.3)
        await mesh.prefill_stub.Prefill(mesh.request("left-dropped", mesh.llama, prompt_of(20, seed=13), LONG))
        await wait_until(lambda: len(heard) == 3, what="three announcements")
    finally:
        await bus.close()
    done = heard["left-done"]
    assert (done.worker_id, done.model, done.num_kv_tokens, done.num_output_tokens, done.finish_reason) == (
        "decode-t",
        mesh.llama,
        25 + 9,
        10,
        "length",
    )
    aborted = heard["left-abort"]
    assert aborted.finish_reason == "abort" and aborted.num_output_tokens >= 2
    assert aborted.num_kv_tokens == 20 + aborted.num_output_tokens - 1
    dropped = heard["left-dropped"]
    assert (dropped.num_kv_tokens, dropped.num_output_tokens, dropped.finish_reason) == (20, 1, "dropped")
    assert done.timestamp_ms <= aborted.timestamp_ms <= dropped.timestamp_ms


def push_header(request_id: str, model: str, num_tokens: int, layout: common_pb2.KVLayout) -> decode_pb2.KVPushMessage:
    return decode_pb2.KVPushMessage(
        header=decode_pb2.KVPushHeader(
            request_id=request_id,
            model=model,
            prompt_token_ids=prompt_of(num_tokens, seed=num_tokens),
            output_token_ids=[7],
            sampling=sampling_to_proto(GREEDY),
            layout=layout,
            num_tokens=num_tokens,
            num_blocks=cdiv(num_tokens, 16),
        )
    )


async def test_a_full_or_missing_decode_worker_fails_the_prefill_naming_it(mesh: Mesh):
    small = mesh.small_decode
    # a push that reserved 7 of the 8 blocks and is still sending its chunks
    held = mesh.small_decode_stub.PushKV()
    await held.write(push_header("holds-blocks", mesh.llama, 100, layout_to_proto(small.engines.layout(mesh.llama))))
    await wait_until(lambda: small.engines.stats()[mesh.llama].num_free_kv_blocks == 1, what="blocks reserved")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.prefill_stub.Prefill(
            mesh.request("no-room", mesh.llama, prompt_of(40, seed=6), GREEDY, decode=small)
        )
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no free KV blocks" in error.value.details()
    assert trailing(error.value)[rpc.FAILED_WORKER_KEY] == "decode-small"
    await wait_for_free_blocks(mesh.prefill, mesh.llama)  # released after the failed push
    held.cancel()  # a push stream that breaks midway frees what it reserved
    await wait_for_free_blocks(small, mesh.llama)

    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.prefill_stub.Prefill(
            mesh.request(
                "unreachable",
                mesh.llama,
                prompt_of(40, seed=6),
                GREEDY,
                decode_address=f"127.0.0.1:{free_port()}",
                decode_worker_id="decode-gone",
                decode_data_address=f"127.0.0.1:{free_port()}",
            )
        )
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert trailing(error.value)[rpc.FAILED_WORKER_KEY] == "decode-gone"


async def test_a_cancelled_prefill_frees_its_kv_and_breaks_the_push(mesh: Mesh):
    stalled = StalledDecode()
    server = rpc.create_server()
    decode_pb2_grpc.add_DecodeServicer_to_server(stalled, server)
    port = rpc.bind(server, "127.0.0.1", 0)
    await server.start()
    try:
        call = mesh.prefill_stub.Prefill(
            mesh.request(
                "abandoned",
                mesh.llama,
                prompt_of(37, seed=10),
                GREEDY,
                decode_address=f"127.0.0.1:{port}",
                decode_data_address="",
            )
        )
        await wait_until(lambda: stalled.num_messages == 1 + 3, what="the header and one chunk per layer")
        stats = await engine_stats(mesh.prefill, mesh.llama)
        assert stats.num_free_kv_blocks == stats.num_kv_blocks - 3  # the kept request, waiting on decode
        call.cancel()
        await asyncio.wait_for(stalled.cancelled.wait(), 5.0)  # the push stream broke: decode frees its blocks
        await wait_for_free_blocks(mesh.prefill, mesh.llama)
    finally:
        await server.stop(None)


# -- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, code, message",
    [
        (dict(model="no-such-model"), grpc.StatusCode.NOT_FOUND, "model 'no-such-model' is not served here"),
        (dict(sampling=common_pb2.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in"),
        (dict(sampling=common_pb2.SamplingParams(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(prompt_token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty"),
        (dict(prompt_token_ids=[5, 500]), grpc.StatusCode.INVALID_ARGUMENT, "prompt token ids must be integers"),
        (dict(prompt_token_ids=[-1] * 40), grpc.StatusCode.INVALID_ARGUMENT, "prompt token ids must be integers"),
        (dict(decode_address=""), grpc.StatusCode.INVALID_ARGUMENT, "decode_address is required"),
    ],
    ids=["unknown-model", "top-p", "max-tokens", "empty", "out-of-vocabulary", "negative", "no-decode"],
)
async def test_bad_prefill_requests_get_the_right_codes(mesh: Mesh, change, code, message):
    request = mesh.request("bad", mesh.llama, [5, 6, 7], GREEDY)
    for field, value in change.items():
        if isinstance(value, list):
            request.ClearField(field)
            getattr(request, field).extend(value)
        elif field == "sampling":
            request.sampling.CopyFrom(value)
        else:
            setattr(request, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.prefill_stub.Prefill(request)
    assert error.value.code() == code and message in error.value.details()


async def push(stub: decode_pb2_grpc.DecodeStub, *messages: decode_pb2.KVPushMessage) -> decode_pb2.PushKVResponse:
    return await stub.PushKV(iter(messages))


async def test_bad_pushes_get_the_right_codes_and_free_their_blocks(mesh: Mesh):
    layout = layout_to_proto(mesh.decode.engines.layout(mesh.llama))
    header = decode_pb2.KVPushHeader(
        request_id="pushed",
        model=mesh.llama,
        prompt_token_ids=list(range(3, 23)),
        output_token_ids=[7],
        sampling=sampling_to_proto(GREEDY),
        layout=layout,
        num_tokens=20,
        num_blocks=2,
    )
    chunk = decode_pb2.KVPushMessage(
        chunk=decode_pb2.KVChunk(layer=0, first_block=0, num_blocks=2, data=bytes(2 * LLAMA_BLOCK_BYTES // 3))
    )
    foreign = layout_to_proto(mesh.decode.engines.layout(mesh.deepseek))
    cases = [
        ((chunk,), grpc.StatusCode.INVALID_ARGUMENT, "must start with its header"),
        ((), grpc.StatusCode.INVALID_ARGUMENT, "must start with its header"),
        (
            (decode_pb2.KVPushMessage(header=decode_pb2.KVPushHeader(model="nope", layout=layout, request_id="x")),),
            grpc.StatusCode.NOT_FOUND,
            "model 'nope'",
        ),
        (
            (decode_pb2.KVPushMessage(header=_with(header, layout=foreign, num_blocks=cdiv(20, 16))),),
            grpc.StatusCode.INVALID_ARGUMENT,
            "KV layout mismatch",
        ),
        (
            (decode_pb2.KVPushMessage(header=header), chunk),
            grpc.StatusCode.INVALID_ARGUMENT,
            "incomplete KV push",
        ),  # one layer of three
        (
            (decode_pb2.KVPushMessage(header=header), decode_pb2.KVPushMessage(header=header)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exactly one header",
        ),
    ]
    for messages, code, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await push(mesh.decode_stub, *messages)
        assert (error.value.code(), message in error.value.details()) == (code, True), error.value.details()
    await wait_for_free_blocks(mesh.decode, mesh.llama)

    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="never-pushed")).read()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def _with(header: decode_pb2.KVPushHeader, **fields) -> decode_pb2.KVPushHeader:
    changed = decode_pb2.KVPushHeader()
    changed.CopyFrom(header)
    for field, value in fields.items():
        if isinstance(value, common_pb2.KVLayout):
            getattr(changed, field).CopyFrom(value)
        else:
            setattr(changed, field, value)
    return changed


async def test_settings_fail_naming_the_variable():
    with pytest.raises(SettingError, match="KVMESH_TORCH_THREADS=0"):
        load_settings(PrefillSettings, env={"KVMESH_TORCH_THREADS": "0"})
    with pytest.raises(SettingError, match="KVMESH_STREAM_ATTACH_TIMEOUT_S"):
        load_settings(DecodeSettings, env={"KVMESH_STREAM_ATTACH_TIMEOUT_S": "-1"})
    settings = load_settings(DecodeSettings, env={"KVMESH_MODELS": "a, b", "KVMESH_DEVICE": "cpu"})
    assert settings.models == ("a", "b") and settings.engine_config("a").served_name == "a"


# -- the KV store ----------------------------------------------------------------------------------------
async def test_the_stored_prefix_ends_at_the_first_miss_of_any_node():
    owners = ["a", "b", "a", "b", "a"]
    assert stored_prefix_length(owners, {"a": 3, "b": 2}) == 5
    assert stored_prefix_length(owners, {"a": 3, "b": 1}) == 3
    assert stored_prefix_length(owners, {"a": 1, "b": 2}) == 2
    assert stored_prefix_length(owners, {"b": 2}) == 0


class RecordingStore:
    def __init__(self) -> None:
        self.batches: list[list[bytes]] = []

    def is_available(self) -> bool:
        return True

    async def put(self, blocks) -> None:
        self.batches.append([b.block_hash for b in blocks])


async def test_the_store_writer_drops_what_its_queue_cannot_hold_and_batches_the_rest():
    store = RecordingStore()
    writer = StoreWriter(store, max_queued_bytes=100, max_batch_bytes=80)  # type: ignore[arg-type]
    layout = KVLayout("m", "float32", 16, 1, (1,), 0)
    dropped = metric("kvmesh_prefill_store_dropped_blocks_total")
    writer.offer([StoreBlock(bytes([i]), b"", layout, bytes(30)) for i in range(4)])  # 120 bytes: one too many
    assert metric("kvmesh_prefill_store_dropped_blocks_total") == dropped + 1
    writer.start()
    try:
        assert await writer.flush(5.0)
    finally:
        await writer.stop()
    assert store.batches == [[b"\0", b"\1"], [b"\2"]]  # at most 80 bytes a batch, in order
    assert writer.is_accepting


async def test_blocks_go_to_the_store_and_come_back_to_an_empty_device_cache(mesh: Mesh):
    model, prompt = mesh.llama, prompt_of(50, seed=7)
    engine = mesh.prefill.engines.get(model)
    keys = engine.engine.prompt_block_hashes(prompt)
    assert len(keys) == 3
    batches: list[events_pb2.KVEventBatch] = []

    async def on_batch(batch: events_pb2.KVEventBatch, subject: str) -> None:
        batches.append(batch)

    bus = await Bus.connect(mesh.nats_url, "test-events")
    await bus.subscribe(subjects.kv_events("prefill-t"), events_pb2.KVEventBatch, on_batch)
    await bus.flush()
    one_token = dataclasses.replace(GREEDY, max_tokens=1)
    first = await mesh.prefill_stub.Prefill(mesh.request("to-store", model, prompt, one_token))
    assert first.num_store_tokens == 0

    # written in the background, each block to its rendezvous owner, chained to its parent
    def stored() -> dict[bytes, tuple[str, object]]:
        return {k: (node, store.blocks[k]) for node, store in mesh.stores.items() for k in keys if k in store.blocks}

    await wait_until(lambda: len(stored()) == 3, what="the prompt's blocks in the store")
    parents = [root_hash(model), *keys[:2]]
    layout = layout_to_proto(mesh.prefill.engines.layout(model))
    for key, parent in zip(keys, parents):
        node, block = stored()[key]
        assert node == rendezvous_owner(key, sorted(mesh.stores))
        assert (block.parent_hash, block.layout, len(block.data)) == (parent, layout, LLAMA_BLOCK_BYTES)

    # the device cache forgets everything; the next request finds the prefix in the store
    assert await engine.call(lambda e: e.kv.pool.reset_prefix_cache())
    store_tokens_before = metric("kvmesh_prefill_cached_tokens_total", model=model, tier="store")
    expected, _ = reference_outputs(model, prompt, GREEDY)
    second = await mesh.prefill_stub.Prefill(mesh.request("from-store", model, prompt, GREEDY))
    assert (second.num_cached_tokens, second.num_store_tokens) == (48, 48)
    batches_out = [b async for b in mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="from-store"))]
    assert [second.first_token_id] + [t for b in batches_out for t in b.token_ids] == expected
    assert metric("kvmesh_prefill_cached_tokens_total", model=model, tier="store") == store_tokens_before + 48
    assert mesh.prefill.writer is not None and await mesh.prefill.writer.flush(5.0)
    assert all(mesh.stores[node].num_puts[k] == 1 for k, (node, _) in stored().items())  # injected: not put again
    beat = await next_heartbeat(mesh.nats_url, "prefill", "prefill-t", lambda b: b.load.num_cached_blocks >= 3)
    assert beat.load.num_running == 0 and beat.load.kv_usage == 0

    # the same changes went out on NATS, numbered without gaps
    await bus.flush()
    await wait_until(lambda: any(e.HasField("all_cleared") for b in batches for e in b.events), what="KV events")
    await bus.close()
    assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))
    assert {b.tier for b in batches} == {"device"} and {b.worker_id for b in batches} == {"prefill-t"}
    ours = [e.stored for b in batches for e in b.events if e.HasField("stored") and e.stored.block_hashes[0] == keys[0]]
    assert [(list(e.block_hashes), e.parent_hash, e.model, e.block_size) for e in ours] == [
        (keys, root_hash(model), model, 16)
    ] * 2  # computed, then injected from the store


async def test_a_failing_or_foreign_store_block_is_a_miss_never_a_failure(mesh: Mesh):
    model = mesh.llama
    engine = mesh.prefill.engines.get(model)
    bus = await Bus.connect(mesh.nats_url, "test-dead-store")
    dead = common_pb2.WorkerInfo(
        worker_id="kvcache-dead", role=common_pb2.ROLE_KVCACHE, address=f"127.0.0.1:{free_port()}"
    )
    announcer = Announcer(bus, dead, common_pb2.WorkerLoad, HEARTBEAT_S)
    await announcer.start()
    try:
        assert mesh.prefill.registry is not None
        await wait_until(lambda: mesh.prefill.registry.get("kvcache-dead") is not None, what="the dead node")
        nodes = [*mesh.stores, "kvcache-dead"]
        # a prompt whose first block the dead node owns, and one whose first block a live node owns
        prompts = [prompt_of(40, seed=100 + i) for i in range(40)]
        owners = [rendezvous_owner(engine.engine.prompt_block_hashes(p)[0], nodes) for p in prompts]
        to_dead = prompts[owners.index("kvcache-dead")]
        to_live, live_owner = next((p, o) for p, o in zip(prompts, owners) if o != "kvcache-dead")

        lookup_errors = metric("kvmesh_prefill_store_errors_total", op="lookup")
        expected, _ = reference_outputs(model, to_dead, GREEDY)
        response = await mesh.prefill_stub.Prefill(mesh.request("dead-store", model, to_dead, GREEDY))
        assert response.num_store_tokens == 0 and response.first_token_id == expected[0]
        assert metric("kvmesh_prefill_store_errors_total", op="lookup") == lookup_errors + 1
        await mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="dead-store"))

        # a block the store holds in another layout (another build of the model) is skipped, not injected
        key = engine.engine.prompt_block_hashes(to_live)[0]
        wrong = layout_to_proto(dataclasses.replace(mesh.prefill.engines.layout(model), layer_shape=(1, 2, 3)))
        mesh.stores[live_owner].blocks[key] = _block(key, root_hash(model), wrong, bytes(24))
        response = await mesh.prefill_stub.Prefill(mesh.request("foreign", model, to_live, GREEDY))
        assert (response.num_store_tokens, response.num_cached_tokens) == (0, 0)
        await mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="foreign"))
    finally:
        await announcer.stop()
        await bus.close()
    await wait_for_free_blocks(mesh.decode, model)


async def test_one_tenant_never_gets_another_tenants_kv_through_the_store(mesh: Mesh):
    model, prompt = mesh.llama, prompt_of(50, seed=11)
    engine = mesh.prefill.engines.get(model)
    one_token = dataclasses.replace(GREEDY, max_tokens=1)
    keys_a = engine.engine.prompt_block_hashes(prompt, "tenant-a")
    keys_b = engine.engine.prompt_block_hashes(prompt, "tenant-b")
    assert len(keys_a) == 3 and not set(keys_a) & set(keys_b)  # the salt enters every key: same tokens, other keys
    await mesh.prefill_stub.Prefill(mesh.request("tenant-a", model, prompt, one_token, cache_salt="tenant-a"))
    await wait_until(
        lambda: all(any(k in s.blocks for s in mesh.stores.values()) for k in keys_a),
        what="tenant a's blocks in the store",
    )
    assert await engine.call(lambda e: e.kv.pool.reset_prefix_cache())
    other = await mesh.prefill_stub.Prefill(mesh.request("tenant-b", model, prompt, one_token, cache_salt="tenant-b"))
    assert (other.num_cached_tokens, other.num_store_tokens) == (0, 0)  # the same prompt, none of a's KV
    assert await engine.call(lambda e: e.kv.pool.reset_prefix_cache())
    again = await mesh.prefill_stub.Prefill(mesh.request("tenant-a2", model, prompt, one_token, cache_salt="tenant-a"))
    assert (again.num_cached_tokens, again.num_store_tokens) == (48, 48)  # a itself gets its prefix back


def _block(key: bytes, parent: bytes, layout: common_pb2.KVLayout, data: bytes) -> kvcache_pb2.Block:
    return kvcache_pb2.Block(block_hash=key, parent_hash=parent, layout=layout, data=data)


# -- the process entry point -------------------------------------------------------------------------------
async def test_the_decode_process_announces_itself_and_stops_gracefully_on_sigterm(mesh: Mesh):
    heard: list[events_pb2.WorkerHeartbeat] = []

    async def on_beat(beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        if beat.worker.worker_id == "decode-process":
            heard.append(beat)

    bus = await Bus.connect(mesh.nats_url, "test-process")
    await bus.subscribe(subjects.heartbeat("decode"), events_pb2.WorkerHeartbeat, on_beat)
    env = {
        **os.environ,
        "KVMESH_NATS_URL": mesh.nats_url,
        "KVMESH_MODELS": mesh.llama,
        "KVMESH_WORKER_ID": "decode-process",
        "KVMESH_HEARTBEAT_INTERVAL_S": "0.2",
        "KVMESH_KV_CACHE_MEMORY_BYTES": str(16 * LLAMA_BLOCK_BYTES),
        "KVMESH_LOG_LEVEL": "warning",
    }
    process = subprocess.Popen([sys.executable, "-m", "services.decode"], env=env, stderr=subprocess.PIPE)
    try:
        await wait_until(lambda: bool(heard) or process.poll() is not None, timeout_s=60, what="its heartbeat")
        assert heard, process.stderr.read().decode() if process.stderr else ""
        info = heard[0].worker
        assert (info.role, list(info.models), info.num_kv_blocks, info.block_size) == (
            common_pb2.ROLE_DECODE,
            [mesh.llama],
            16,
            16,
        )
        process.send_signal(signal.SIGTERM)
        await wait_until(lambda: process.poll() is not None, timeout_s=30, what="the process to exit")
        assert process.returncode == 0
        await wait_until(lambda: heard[-1].leaving, timeout_s=5, what="its leaving heartbeat")
    finally:
        if process.poll() is None:
            process.kill()
        await bus.close()
