"""The gateway's public listener, bounded: connections in all and per client address, the time to send a first
request head, and aiohttp's own caps on a head (a line and a field 8,190 bytes, 128 fields: past them a 400).

A connection over a cap is closed as it is accepted (counted in kvmesh_gateway_connections_refused_total, by
reason); one that has not sent a whole request head within `head_timeout_s` is closed (a slowloris holds
nothing for long). Idle keep-alive connections close after `keepalive_timeout_s`. Later heads on a kept-alive
connection are bounded by the caps, not by the head timeout: the wrapper does not parse HTTP.

    listener = await Listener.start(app, host, port, limits)   # instead of web.TCPSite
    ...
    await listener.stop()
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import http_exceptions, web

from mesh.logging import get_logger
from mesh.metrics import GATEWAY_CONNECTIONS_REFUSED

log = get_logger(__name__)
HEAD_END = b"\r\n\r\n"


class _ClientFaults(logging.Filter):
    """aiohttp logs every malformed request with a traceback at ERROR: a log flood anyone can cause. The client
    got its 400; the line is dropped (kvmesh_gateway_connections_refused_total does not count these)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fault = record.exc_info[1] if record.exc_info else None
        return not isinstance(fault, http_exceptions.HttpProcessingError)


logging.getLogger("aiohttp.server").addFilter(_ClientFaults())


@dataclass(frozen=True)
class ListenerLimits:
    max_connections: int = 4096  # in all; 0: no cap
    max_connections_per_client: int = 256  # per client address; 0: no cap
    head_timeout_s: float = 10.0  # accept to the end of the first request head
    keepalive_timeout_s: float = 75.0  # an idle kept-alive connection


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's RequestHandler, with its client counted and its first head timed."""

    def __init__(self, listener: Listener, inner: Any) -> None:
        self._listener = listener
        self._inner = inner
        self._client = ""
        self._tail = b""  # the last bytes seen, to find a head's end across reads
        self._head_timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._is_counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if peer else ""
        refusal = self._listener.admit(self._client)
        if refusal is not None:
            GATEWAY_CONNECTIONS_REFUSED.labels(refusal).inc()
            transport.abort()
            return
        self._is_counted = True
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self._listener.limits.head_timeout_s, self._head_too_slow)
        self._inner.connection_made(transport)

    def _head_too_slow(self) -> None:
        GATEWAY_CONNECTIONS_REFUSED.labels("head_timeout").inc()
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:
            seen = self._tail + data
            if HEAD_END in seen:
                self._head_timer.cancel()
                self._head_timer = None
            self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        if self._is_counted:
            self._is_counted = False
            self._listener.release(self._client)
            self._inner.connection_lost(exc)


class Listener:
    def __init__(self, runner: web.AppRunner, limits: ListenerLimits) -> None:
        self.runner = runner
        self.limits = limits
        self.port = 0
        self._per_client: collections.Counter[str] = collections.Counter()
        self._num_connections = 0  # the sum of _per_client, kept: every accept reads it
        self._server: asyncio.Server | None = None

    @property
    def num_connections(self) -> int:
        return self._num_connections

    def admit(self, client: str) -> str | None:
        """Count a new connection from `client`; the reason it is refused, or None."""
        limits = self.limits
        if limits.max_connections and self.num_connections >= limits.max_connections:
            return "max_connections"
        if limits.max_connections_per_client and self._per_client[client] >= limits.max_connections_per_client:
            return "max_connections_per_client"
        self._per_client[client] += 1
        self._num_connections += 1
        return None

    def release(self, client: str) -> None:
        self._per_client[client] -= 1
        self._num_connections -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]

    @classmethod
    async def start(
        cls, app: web.Application, host: str, port: int, limits: ListenerLimits, reuse_port: bool = False
    ) -> Listener:
        """Serve `app` on host:port (0: any free port). A client that disconnects cancels its handler, which
        is what cancels the gRPC calls made for it. `reuse_port`: SO_REUSEPORT, for replicas sharing the port
        (the kernel spreads new connections among them; one that dies takes only its own connections along)."""
        runner = web.AppRunner(  # bodies are not inflated: rest.json_body refuses a Content-Encoding unread
            app,
            access_log=None,
            handler_cancellation=True,
            keepalive_timeout=limits.keepalive_timeout_s,
            auto_decompress=False,
        )
        await runner.setup()
        listener = cls(runner, limits)
        server = runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        listener._server = await loop.create_server(
            lambda: _Guarded(listener, server()), host, port, reuse_address=True, reuse_port=reuse_port or None
        )
        listener.port = int(listener._server.sockets[0].getsockname()[1])
        return listener

    async def stop(self) -> None:
        """No new connections; the open ones end as aiohttp's shutdown ends them."""
        if self._server is not None:
            self._server.close()
        await self.runner.cleanup()
        if self._server is not None:
            await self._server.wait_closed()
