"""What the service tests share: a role's serve() running in-process, and polling. NATS is the real nats-server
(kvmesh.nats_server.EmbeddedNats: the binary next to the interpreter, on a free port, with JetStream)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc.aio

from mesh import rpc, tls
from mesh.access import GATEWAY
from mesh.config import ServiceSettings

S = TypeVar("S", bound=ServiceSettings)


@contextlib.asynccontextmanager
async def serving(
    serve: Callable[[S], Awaitable[None]], settings: S, caller: str = GATEWAY
) -> AsyncIterator[grpc.aio.Channel]:
    """Run `serve(settings)` in this event loop; yields a channel to its gRPC port, calling as a `caller` (mutual
    TLS with that role's certificate). On exit the service is cancelled, which runs its graceful shutdown (a
    `leaving` heartbeat, drain, close)."""
    task = asyncio.ensure_future(serve(settings))
    channels = rpc.Channels(tls.load_credentials(caller))
    channel = channels.get(f"127.0.0.1:{settings.grpc_port}")
    ready = asyncio.ensure_future(channel.channel_ready())
    try:
        await asyncio.wait([ready, task], timeout=10.0, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # serve() failed at start: raise its error
        assert ready.done(), "the service did not serve gRPC within 10 s"
        yield channel
    finally:
        ready.cancel()
        await channels.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> float:
    """Poll `condition` until it holds; returns the seconds it took."""
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < timeout_s, f"condition not met within {timeout_s} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - start
