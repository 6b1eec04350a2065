"""A decode worker that is full, unreachable or stalled fails the prefill naming it, and frees every block on
both sides.

Harness: the `mesh` fixture of tests/services/pd_harness.py (in-process workers).
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from engine_core.kv_cache.manager import cdiv
from kvmesh.nats_server import free_port
from mesh import rpc, tls
from mesh.access import DECODE
from mesh.compute.convert import layout_to_proto, sampling_to_proto
from mesh.pb import common_pb2, decode_pb2, decode_pb2_grpc

from . import pd_harness
from .pd_harness import GREEDY, Mesh, engine_stats, prompt_of, trailing, wait_for_free_blocks, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, nats_url = pd_harness.mesh, pd_harness.nats_url  # fixtures: each test file starts its own mesh


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


async def test_a_cancelled_prefill_frees_its_kv_and_breaks_the_push(mesh: Mesh):
    stalled = StalledDecode()
    credentials = tls.load_credentials(DECODE)
    server = rpc.create_server(credentials)
    decode_pb2_grpc.add_DecodeServicer_to_server(stalled, server)
    port = rpc.bind(server, "127.0.0.1", 0, credentials)
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
