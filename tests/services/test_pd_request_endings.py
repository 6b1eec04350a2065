"""How a request leaves a decode worker: a cancelled stream, an abort, a stream nobody follows; each frees its
KV blocks, and each departure is announced on NATS with its KV length.

Harness: the `mesh` fixture of tests/services/pd_harness.py (in-process workers).
"""

from __future__ import annotations

import time

import grpc
import grpc.aio
import pytest

from engine_core import SamplingParams
from mesh import subjects
from mesh.bus import Bus
from mesh.compute.faults import Faults
from mesh.pb import common_pb2, decode_pb2, events_pb2

from . import pd_harness
from .pd_harness import GREEDY, LONG, Mesh, engine_stats, next_heartbeat, prompt_of, wait_for_free_blocks, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, nats_url = pd_harness.mesh, pd_harness.nats_url  # fixtures: each test file starts its own mesh


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


async def test_an_injected_error_fails_the_stream_unavailable_and_frees_its_blocks(mesh: Mesh, monkeypatch):
    monkeypatch.setattr(mesh.decode.decoder, "faults", Faults(error_rate=1.0))  # KVMESH_FAULT_ERROR_RATE=1
    await mesh.prefill_stub.Prefill(mesh.request("faulty", mesh.llama, prompt_of(20, seed=11), LONG))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="faulty")).read()
    assert (error.value.code(), error.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "injected fault (KVMESH_FAULT_ERROR_RATE)",
    )
    await wait_for_free_blocks(mesh.decode, mesh.llama)


async def test_an_injected_token_delay_slows_the_stream_not_its_tokens(mesh: Mesh, monkeypatch):
    prompt = prompt_of(20, seed=12)

    async def stream(request_id: str) -> tuple[list[int], float]:
        started = time.monotonic()
        await mesh.prefill_stub.Prefill(mesh.request(request_id, mesh.llama, prompt, GREEDY))
        tokens: list[int] = []
        async for batch in mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id=request_id)):
            tokens += batch.token_ids
        return tokens, time.monotonic() - started

    tokens, _ = await stream("undelayed")
    monkeypatch.setattr(mesh.decode.decoder, "faults", Faults(token_delay_s=0.1))  # KVMESH_FAULT_TOKEN_DELAY_S
    delayed_tokens, delayed_s = await stream("delayed")
    assert delayed_tokens == tokens and len(tokens) == GREEDY.max_tokens - 1  # decode streams all but prefill's
    assert delayed_s >= 0.1 * len(tokens)
