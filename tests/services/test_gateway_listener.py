"""The gateway's public listener (services/gateway/listener.py) over real sockets: connection caps in all and
per client, the first head's deadline, aiohttp's head caps, and normal requests served throughout."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from mesh.metrics import GATEWAY_CONNECTIONS_REFUSED
from services.gateway.listener import Listener, ListenerLimits


async def hello(_: web.Request) -> web.Response:
    return web.Response(text="hello")


@pytest.fixture
async def serve() -> AsyncIterator[object]:
    listeners: list[Listener] = []

    async def start(limits: ListenerLimits) -> Listener:
        app = web.Application()
        app.router.add_get("/", hello)
        listener = await Listener.start(app, "127.0.0.1", 0, limits)
        listeners.append(listener)
        return listener

    yield start
    for listener in listeners:
        await listener.stop()


async def connect(listener: Listener) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", listener.port)


async def get(listener: Listener, head: bytes = b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n") -> bytes:
    reader, writer = await connect(listener)
    writer.write(head)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def is_closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def refused(reason: str) -> float:
    return GATEWAY_CONNECTIONS_REFUSED.labels(reason)._value.get()


async def test_a_client_over_its_connection_cap_is_closed_and_others_go_on(serve) -> None:  # type: ignore[no-untyped-def]
    listener = await serve(ListenerLimits(max_connections=0, max_connections_per_client=3, head_timeout_s=30))
    before = refused("max_connections_per_client")
    idle = [await connect(listener) for _ in range(3)]
    await asyncio.sleep(0.1)
    assert listener.num_connections == 3
    reader, _ = await connect(listener)  # the 4th from this address
    assert await is_closed_by_server(reader, 2.0)
    assert refused("max_connections_per_client") - before == 1
    idle.pop()[1].close()  # one leaves: room for a real request
    await asyncio.sleep(0.1)
    assert (await get(listener)).startswith(b"HTTP/1.1 200")
    for _, writer in idle:
        writer.close()


async def test_the_cap_in_all_holds(serve) -> None:  # type: ignore[no-untyped-def]
    listener = await serve(ListenerLimits(max_connections=2, max_connections_per_client=0, head_timeout_s=30))
    before = refused("max_connections")
    idle = [await connect(listener) for _ in range(2)]
    await asyncio.sleep(0.1)
    reader, _ = await connect(listener)
    assert await is_closed_by_server(reader, 2.0)
    assert refused("max_connections") - before == 1
    for _, writer in idle:
        writer.close()
    await asyncio.sleep(0.1)
    assert listener.num_connections == 0


async def test_a_head_not_finished_in_time_is_closed_while_a_prompt_one_is_served(serve) -> None:  # type: ignore[no-untyped-def]
    listener = await serve(ListenerLimits(max_connections_per_client=0, head_timeout_s=0.5))
    before = refused("head_timeout")
    slow = [await connect(listener) for _ in range(200)]  # 200 slowloris connections, half a head each
    for _, writer in slow:
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n")
    assert (await get(listener)).startswith(b"HTTP/1.1 200")  # served meanwhile
    closed = await asyncio.gather(*(is_closed_by_server(reader, 5.0) for reader, _ in slow))
    assert all(closed)
    assert refused("head_timeout") - before == 200
    await asyncio.sleep(0.1)
    assert listener.num_connections == 0
    # a head split over reads, the end straddling two of them, is still a head in time
    reader, writer = await connect(listener)
    for part in (b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r", b"\n\r", b"\n"):
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.1)
    assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")


async def test_an_oversized_head_is_a_400_and_no_traceback_in_the_log(  # type: ignore[no-untyped-def]
    serve, caplog: pytest.LogCaptureFixture
) -> None:
    listener = await serve(ListenerLimits())
    huge = b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n"
    assert (await get(listener, huge)).split(b" ")[1] == b"400"
    many = b"GET / HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(1000)) + b"\r\n"
    assert (await get(listener, many)).split(b" ")[1] == b"400"
    assert (await get(listener)).startswith(b"HTTP/1.1 200")
    assert [r for r in caplog.records if r.name == "aiohttp.server"] == []  # no flood of tracebacks
