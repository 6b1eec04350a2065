"""The bounds every gRPC server of the mesh sets (mesh.rpc.SERVER_OPTIONS), on a real server and channel."""

from __future__ import annotations

import grpc
import grpc.aio

from mesh import rpc

ECHO = "/kvmesh.test.Echo/Say"


def _echo_handler() -> grpc.GenericRpcHandler:
    async def say(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(say)
    return grpc.method_handlers_generic_handler("kvmesh.test.Echo", {"Say": handler})


async def test_a_call_with_oversized_metadata_is_refused_and_the_next_one_served() -> None:
    server = rpc.create_public_server()
    server.add_generic_rpc_handlers((_echo_handler(),))
    port = rpc.bind(server, "127.0.0.1", 0, None)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=rpc.OPTIONS) as channel:
            say = channel.unary_unary(ECHO)
            assert await say(b"hi", timeout=5) == b"hi"
            try:
                await say(b"hi", metadata=(("x-big", "a" * 20_000),), timeout=5)
                raise AssertionError("20 KB of metadata was accepted")
            except grpc.aio.AioRpcError as error:
                assert error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
            assert await say(b"again", metadata=(("x-small", "a" * 1000),), timeout=5) == b"again"
    finally:
        await server.stop(None)


async def test_a_taken_port_is_an_error_not_a_shared_port() -> None:
    """gRPC's default SO_REUSEPORT would let a second server share a port with the first (the kernel splitting
    connections between them): a mesh server refuses; only gateway replicas, asking for it, share."""
    first = rpc.create_server(None)
    first.add_generic_rpc_handlers((_echo_handler(),))
    port = rpc.bind(first, "127.0.0.1", 0, None)
    await first.start()
    try:
        for second in (rpc.create_server(None), rpc.create_public_server()):
            try:
                rpc.bind(second, "127.0.0.1", port, None)
                raise AssertionError(f"a second server bound port {port}, taken")
            except (OSError, RuntimeError) as error:
                assert str(port) in str(error)
        replica, other_replica = rpc.create_public_server(reuse_port=True), rpc.create_public_server(reuse_port=True)
        shared = rpc.bind(replica, "127.0.0.1", 0, None)
        assert rpc.bind(other_replica, "127.0.0.1", shared, None) == shared
    finally:
        await first.stop(None)
