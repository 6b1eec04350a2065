"""The server's bounds on a request's work: output length (KVMESH_DEFAULT_MAX_TOKENS, KVMESH_MAX_OUTPUT_TOKENS) on
every API, where the default reaches the prefill worker if the client set none and a value over the maximum is
a 400 (gRPC: INVALID_ARGUMENT) naming the client's own field; and the request deadline (KVMESH_REQUEST_TIMEOUT_S),
past which the client gets a 504 and the decode worker's stream is cancelled (which frees its KV: decode aborts a
request whose stream is cancelled, tests/integration/test_mesh.py).

Harness: `running_mesh` of tests/services/gateway_harness.py (scripted workers), with the bounds set.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import grpc.aio
import pytest
import pytest_asyncio

from mesh.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.output_limits import OutputLimits, parse_per_model

from . import gateway_harness
from .gateway_harness import IDLE_MODEL, KEY, MODEL, Mesh, Script, running_mesh, wait_for

IN_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

script = gateway_harness.script  # a fresh script per test, over this file's `mesh`

DEFAULT, MAXIMUM = 7, 9
TIMEOUT_S = 5.0


def test_the_settings_read_one_value_or_one_per_model() -> None:
    assert parse_per_model(("4096", "deepseek-tiny=1024"), "default_max_tokens") == {"": 4096, "deepseek-tiny": 1024}
    limits = OutputLimits(parse_per_model(("100", "a=10"), "d"), parse_per_model(("b=20",), "m"))
    assert [(limits.default_for(m), limits.maximum_for(m)) for m in ("a", "b", "c")] == [(10, 0), (100, 20), (100, 0)]
    for bad in (("a=x",), ("-1",), ("5", "7")):
        with pytest.raises(ValueError, match="max_output_tokens: "):
            parse_per_model(bad, "max_output_tokens")


def test_the_default_is_cut_to_the_context_and_never_below_min_tokens() -> None:
    limits = OutputLimits({"": 100}, {})
    sampling = common_pb2.SamplingParams()
    limits.apply("m", 40, sampling, "max_tokens")
    assert sampling.max_tokens == 40  # the room the context leaves
    sampling = common_pb2.SamplingParams(min_tokens=150)
    limits.apply("m", 1000, sampling, "max_tokens")
    assert sampling.max_tokens == 150
    unbounded = common_pb2.SamplingParams()
    OutputLimits().apply("m", 1000, unbounded, "max_tokens")
    assert not unbounded.HasField("max_tokens")  # no bounds: the rest of the context, as before


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    bounds = {
        "default_max_tokens": (str(DEFAULT),),
        "max_output_tokens": ("1000", f"{MODEL}={MAXIMUM}"),
        "request_timeout_s": TIMEOUT_S,
    }
    async with running_mesh(**bounds) as running:
        yield running


async def post(mesh: Mesh, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as session, session.post(mesh.base_url + path, json=body, headers=headers) as r:
        return r.status, await r.json()


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
CASES = [  # (path, body without a length, the client's name for it)
    ("/v1/chat/completions", CHAT, "max_completion_tokens"),
    ("/v1/chat/completions", CHAT, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi"}, "max_tokens"),
    ("/v1/responses", {"model": MODEL, "input": "Hi"}, "max_output_tokens"),
    ("/v1/messages", {**CHAT, "max_tokens": 1}, "max_tokens"),
]


@IN_MODULE_LOOP
async def test_every_api_without_a_length_gets_the_default(mesh: Mesh, script: Script) -> None:
    for path, body, _ in CASES[:4]:
        status, answer = await post(mesh, path, body)
        assert status == 200, (path, answer)
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(model=MODEL, prompt="Hi")
        [r async for r in stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),))]
    # legacy completions: its API's 16, cut to the maximum
    assert [p.sampling.max_tokens for p in script.prefills] == [DEFAULT, DEFAULT, MAXIMUM, DEFAULT, DEFAULT]


@IN_MODULE_LOOP
async def test_asking_past_the_models_maximum_is_a_400_naming_the_field(mesh: Mesh, script: Script) -> None:
    for path, body, field in CASES:
        status, answer = await post(mesh, path, {**body, field: MAXIMUM + 1})
        message = answer["error"]["message"]
        expected = (
            f"{field} is too large: {MAXIMUM + 1}; this server allows at most {MAXIMUM} output tokens for {MODEL!r}"
        )
        assert (status, expected in message) == (400, True), (path, answer)
        if path != "/v1/messages":  # Anthropic's error body has no param
            assert answer["error"]["param"] == field
        status, _ = await post(mesh, path, {**body, field: MAXIMUM})
        assert status == 200, path
    status, answer = await post(mesh, "/v1/completions", {"model": IDLE_MODEL, "prompt": "Hi", "max_tokens": 10})
    assert status != 400  # 1000 for every other model (no worker serves this one: a 503)
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        sampling = common_pb2.SamplingParams(max_tokens=MAXIMUM + 1)
        request = gateway_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=sampling)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),))]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.max_tokens is too large: 10" in (error.value.details() or "")


@IN_MODULE_LOOP
async def test_a_request_past_its_deadline_is_a_504_and_its_decode_stream_is_cancelled(
    mesh: Mesh, script: Script
) -> None:
    script.token_ids, script.batch_size, script.batch_delay_s = list(range(100, 160)), 1, 0.2  # a 12 s stream
    started = asyncio.get_running_loop().time()
    status, answer = await post(mesh, "/v1/chat/completions", CHAT)
    assert (status, answer["error"]["code"]) == (504, "timeout")
    assert TIMEOUT_S <= asyncio.get_running_loop().time() - started < TIMEOUT_S + 3
    await wait_for(lambda: script.stream_ends == ["cancelled"])
    assert script.stream_ends == ["cancelled"]
