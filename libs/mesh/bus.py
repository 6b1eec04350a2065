"""The NATS bus: protobuf messages on subjects, with the request id in the `x-request-id` header.

Events only: bulk bytes (KV blocks, embeddings) travel over gRPC, never through NATS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.logging import REQUEST_ID_KEY, bind_request_id, current_request_id, get_logger

M = TypeVar("M", bound=Message)
log = get_logger(__name__)


class BusError(RuntimeError):
    """NATS cannot be reached."""


class Bus:
    def __init__(self, client: Client) -> None:
        self.client = client

    @classmethod
    async def connect(cls, url: str, name: str, timeout_s: float = 5.0) -> Bus:
        """Connect, failing within `timeout_s` with an error naming the URL; reconnects forever afterwards."""

        async def on_error(exc: Exception) -> None:  # one line, not the client's traceback per retry
            log.warning("nats error", url=url, error=f"{type(exc).__name__}: {exc}")

        async def on_disconnected() -> None:
            log.warning("nats disconnected; reconnecting", url=url)

        async def on_reconnected() -> None:
            log.info("nats reconnected", url=url)

        try:
            client = await asyncio.wait_for(
                nats.connect(
                    url,
                    name=name,
                    connect_timeout=timeout_s,
                    max_reconnect_attempts=-1,
                    allow_reconnect=True,
                    reconnect_time_wait=0.5,
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected,
                ),
                timeout=timeout_s * 2,
            )
        except (OSError, asyncio.TimeoutError, nats.errors.NoServersError) as exc:
            raise BusError(f"cannot reach NATS at {url}: {exc or type(exc).__name__}") from exc
        return cls(client)

    async def publish(self, subject: str, message: Message, request_id: str | None = None) -> None:
        request_id = request_id or current_request_id()
        headers = {REQUEST_ID_KEY: request_id} if request_id else None
        await self.client.publish(subject, message.SerializeToString(), headers=headers)

    async def subscribe(
        self, subject: str, message_type: type[M], handler: Callable[[M, str], Awaitable[None]]
    ) -> Subscription:
        """Call `handler(message, subject)` for each message; undecodable ones are logged and dropped."""

        async def on_message(msg: Msg) -> None:
            message = message_type()
            try:
                message.ParseFromString(msg.data)
            except DecodeError:
                log.warning("undecodable message dropped", subject=msg.subject, type=message_type.__name__)
                return
            with bind_request_id((msg.headers or {}).get(REQUEST_ID_KEY)):
                try:
                    await handler(message, msg.subject)
                except Exception:  # one bad event must not stop the subscription
                    log.exception("event handler failed", subject=msg.subject)

        return await self.client.subscribe(subject, cb=on_message)

    async def flush(self) -> None:
        await self.client.flush()

    async def close(self) -> None:
        """Drain (deliver what is queued) and close; if NATS is already gone, just close."""
        if self.client.is_closed:
            return
        try:
            await asyncio.wait_for(self.client.drain(), timeout=5)
        except (nats.errors.Error, asyncio.TimeoutError, OSError):
            await self.client.close()

    @property
    def is_connected(self) -> bool:
        return bool(self.client.is_connected)


def decode(message_type: type[M], data: bytes) -> M:
    message = message_type()
    message.ParseFromString(data)
    return message


__all__ = ["Any", "Bus", "BusError", "decode"]
