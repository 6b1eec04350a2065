"""The gateway's own gRPC API (Generate, ListModels): text and token-id prompts, cache salts, and status codes.

Harness: the `mesh` and `script` fixtures of tests/services/gateway_harness.py (scripted workers).
"""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
import pytest

from engine_core.kv_cache.block_hash import hash_token_blocks, root_hash
from mesh.pb import common_pb2, gateway_pb2, gateway_pb2_grpc

from . import gateway_harness
from .gateway_harness import COMPLETION, IDLE_MODEL, KEY, MODEL, NUM_CACHED, Mesh, Script, prompt_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, script = gateway_harness.mesh, gateway_harness.script  # fixtures: each test file starts its own gateway


AUTH = (("authorization", f"Bearer {KEY}"),)


async def test_grpc_generate(mesh: Mesh, script: Script) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            model=MODEL,
            messages=[gateway_pb2.ChatMessage(role="user", content="Hi")],
            stop=["now"],
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=30),
            cache_salt="tenant-1",
        )
        responses = [r async for r in stub.Generate(request, metadata=AUTH)]
    assert "".join(r.text for r in responses) == "Hello world. Bye "
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (
        len(prompt_ids(mesh)),
        len(script.token_ids),
        NUM_CACHED,
    )
    assert {(r.prefill_worker, r.decode_worker) for r in responses} == {("prefill-a", "decode-a")}
    assert [t for r in responses for t in r.token_ids] == script.token_ids
    (route,) = script.routes
    assert list(route.block_hashes) == hash_token_blocks(root_hash(MODEL, "tenant-1"), prompt_ids(mesh), 16)
    assert script.prefills[0].cache_salt == "tenant-1"


async def test_grpc_token_ids_prompt(mesh: Mesh, script: Script) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(model=MODEL, prompt_token_ids=[5, 6, 7])
        responses = [r async for r in stub.Generate(request, metadata=AUTH)]
    assert "".join(r.text for r in responses) == COMPLETION
    assert list(script.prefills[0].prompt_token_ids) == [5, 6, 7]


@pytest.mark.parametrize(
    ("request_fields", "metadata", "code"),
    [
        ({"model": MODEL, "prompt": "Hi"}, (("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
        ({"model": MODEL, "prompt": "Hi"}, (), grpc.StatusCode.UNAUTHENTICATED),
        ({"model": "gpt-17", "prompt": "Hi"}, AUTH, grpc.StatusCode.NOT_FOUND),
        ({"model": MODEL}, AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": MODEL, "prompt": "Hi", "prompt_token_ids": [1]}, AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": MODEL, "prompt_token_ids": [10**7]}, AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        (
            {"model": MODEL, "prompt": "Hi", "sampling": common_pb2.SamplingParams(top_p=2.0)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"model": IDLE_MODEL, "prompt": "Hi"}, AUTH, grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_grpc_errors(
    mesh: Mesh,
    script: Script,
    request_fields: dict[str, Any],
    metadata: tuple[tuple[str, str], ...],
    code: grpc.StatusCode,
) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(gateway_pb2.GenerateRequest(**request_fields), metadata=metadata):
                pass
    assert caught.value.code() == code
    assert script.routes == []


async def test_grpc_list_models(mesh: Mesh, script: Script) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        response = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=AUTH)
        assert [(m.id, m.max_model_len) for m in response.models] == [(MODEL, mesh.model.context_len)]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListModels(gateway_pb2.ListModelsRequest())
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
