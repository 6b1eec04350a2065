"""What it takes for grpc-python to move bulk bytes: one server process, one client process, loopback, the same
bytes through several variants (`kvmesh bench kv-transfer --explore`):

- api: `aio` (grpc.aio, what every kvmesh role runs) or `sync` (grpc's thread-pool server and blocking stubs);
- codec: `identity` (generic handlers whose serializers pass bytes through: no protobuf at all) or `protobuf`
  (kvcache.proto's Block, as the store speaks);
- message size, and concurrent streams (each on its own channel, so its own TCP connection).

Each variant streams `megabytes` from server to client (a server stream, like KVCache.Get); best of `repeats`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from concurrent import futures
from typing import Any

import grpc
import grpc.aio

from kvmesh.nats_server import free_port
from mesh.pb import kvcache_pb2

OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
SERVICE = "kvmesh.bench.Bulk"


def _identity(data: bytes) -> bytes:
    return data


def _request(total: int, size: int) -> bytes:
    return total.to_bytes(8, "little") + size.to_bytes(8, "little")


def _parse(request: bytes) -> tuple[int, int]:
    return int.from_bytes(request[:8], "little"), int.from_bytes(request[8:16], "little")


def _messages(request: bytes, codec: str):
    total, size = _parse(request)
    payload = os.urandom(size)
    message: Any = payload
    if codec == "protobuf":
        message = kvcache_pb2.Block(block_hash=bytes(32), parent_hash=bytes(32), data=payload, checksum=1)
    for _ in range(total // size):
        yield message


def _handlers() -> grpc.GenericRpcHandler:
    def identity(request: bytes, context: Any):
        yield from _messages(request, "identity")

    def protobuf(request: bytes, context: Any):
        yield from _messages(request, "protobuf")

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Identity": grpc.unary_stream_rpc_method_handler(
                identity, request_deserializer=_identity, response_serializer=_identity
            ),
            "Protobuf": grpc.unary_stream_rpc_method_handler(
                protobuf, request_deserializer=_identity, response_serializer=kvcache_pb2.Block.SerializeToString
            ),
        },
    )


def _aio_handlers() -> grpc.GenericRpcHandler:
    async def identity(request: bytes, context: Any):
        for message in _messages(request, "identity"):
            yield message

    async def protobuf(request: bytes, context: Any):
        for message in _messages(request, "protobuf"):
            yield message

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Identity": grpc.unary_stream_rpc_method_handler(
                identity, request_deserializer=_identity, response_serializer=_identity
            ),
            "Protobuf": grpc.unary_stream_rpc_method_handler(
                protobuf, request_deserializer=_identity, response_serializer=kvcache_pb2.Block.SerializeToString
            ),
        },
    )


def _serve(aio_port: int, sync_port: int) -> None:
    sync_server = grpc.server(futures.ThreadPoolExecutor(8), options=OPTIONS)
    sync_server.add_generic_rpc_handlers((_handlers(),))
    sync_server.add_insecure_port(f"127.0.0.1:{sync_port}")
    sync_server.start()

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((_aio_handlers(),))
        server.add_insecure_port(f"127.0.0.1:{aio_port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _deserializer(codec: str) -> Any:
    return _identity if codec == "identity" else kvcache_pb2.Block.FromString


async def _aio_round(port: int, codec: str, total: int, size: int, streams: int) -> float:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) for _ in range(streams)]
    method = f"/{SERVICE}/{'Identity' if codec == 'identity' else 'Protobuf'}"

    async def pull(channel: grpc.aio.Channel, num_bytes: int) -> None:
        call = channel.unary_stream(method, request_serializer=_identity, response_deserializer=_deserializer(codec))
        async for _ in call(_request(num_bytes, size)):
            pass

    await asyncio.gather(*(pull(c, size) for c in channels))  # connect
    started = time.perf_counter()
    await asyncio.gather(*(pull(c, total // streams) for c in channels))
    elapsed = time.perf_counter() - started
    for channel in channels:
        await channel.close()
    return elapsed


def _sync_round(port: int, codec: str, total: int, size: int, streams: int) -> float:
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) for _ in range(streams)]
    method = f"/{SERVICE}/{'Identity' if codec == 'identity' else 'Protobuf'}"

    def pull(channel: grpc.Channel, num_bytes: int) -> None:
        call = channel.unary_stream(method, request_serializer=_identity, response_deserializer=_deserializer(codec))
        for _ in call(_request(num_bytes, size)):
            pass

    with futures.ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda c: pull(c, size), channels))
        started = time.perf_counter()
        list(pool.map(lambda c: pull(c, total // streams), channels))
        elapsed = time.perf_counter() - started
    for channel in channels:
        channel.close()
    return elapsed


def explore(megabytes: int = 128, repeats: int = 3) -> list[dict[str, Any]]:
    aio_port, sync_port = free_port(), free_port()
    server = multiprocessing.Process(target=_serve, args=(aio_port, sync_port), daemon=True)
    server.start()
    time.sleep(1.5)
    total = megabytes << 20
    rows = []
    try:
        for api in ("aio", "sync"):
            for codec in ("identity", "protobuf"):
                for size_mib in (1, 4, 16):
                    for streams in (1, 2, 4):
                        port = aio_port if api == "aio" else sync_port
                        size = size_mib << 20
                        best = min(
                            asyncio.run(_aio_round(port, codec, total, size, streams))
                            if api == "aio"
                            else _sync_round(port, codec, total, size, streams)
                            for _ in range(repeats)
                        )
                        rows.append(
                            {
                                "api": api,
                                "codec": codec,
                                "message_mib": size_mib,
                                "streams": streams,
                                "gbps": round(total / best / 1e9, 3),
                            }
                        )
    finally:
        server.terminate()
    return rows
