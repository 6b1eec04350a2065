"""The NATS bus: protobuf messages on subjects, with the request id in the `x-request-id` header and, while
tracing is on, the sender's span in `traceparent` (a message that carries one is handled in a span of its trace).

Events only: bulk bytes (KV blocks, embeddings) travel over gRPC, never through NATS.

A role joins as its NATS user (`connect_as`: KVMESH_NATS_CREDS, or nats.creds beside its certificate, or
user:password in the URL), presenting its mesh certificate when the server asks for TLS; what the user may publish
and subscribe is mesh.bus_auth's table. URLs are logged and raised with the user and password cut out (`redact`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import nats
import nats.js.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import SpanKind

from mesh.bus_auth import CREDS_FILE, NatsUser, read_user
from mesh.config import NatsSettings, TLSSettings, load_settings
from mesh.logging import REQUEST_ID_KEY, bind_request_id, current_request_id, get_logger
from mesh.tls import CertificateError, MeshCredentials, client_ssl_context, load_credentials
from mesh.tracing import TRACEPARENT, context_from, span
from mesh.tracing import headers as trace_headers

M = TypeVar("M", bound=Message)
T = TypeVar("T")
log = get_logger(__name__)


class BusError(RuntimeError):
    """NATS cannot be reached, or refused this process's credentials."""


def redact(url: str) -> str:
    """`url` (or a comma-separated list of them) with any user and password replaced by `***`."""
    servers = []
    for server in url.split(","):
        parts = urlsplit(server.strip())
        if "@" in parts.netloc:
            parts = parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2])
        servers.append(parts.geturl())
    return ",".join(servers)


def servers(url: str) -> list[str]:
    """The servers of a URL list (`nats://a:4222,nats://b:4222`: a cluster's nodes), for the client's pool: it
    connects to one and moves to another when that one goes."""
    return [server.strip() for server in url.split(",") if server.strip()]


def has_userinfo(url: str) -> bool:
    return any("@" in urlsplit(server.strip()).netloc for server in url.split(","))


def load_user(role: str, env: dict[str, str] | None = None) -> NatsUser | None:
    """This process's NATS user as `role`: KVMESH_NATS_CREDS, else nats.creds in KVMESH_TLS_DIR or its <role>/
    (where `kvmesh certs init` puts it), else None (then only a user:password in the URL authenticates)."""
    creds = load_settings(NatsSettings, env).nats_creds
    if creds:
        return read_user(Path(creds).expanduser())
    tls_dir = load_settings(TLSSettings, env).tls_dir
    for base in (Path(tls_dir).expanduser(),) if tls_dir else ():
        for path in (base / CREDS_FILE, base / role / CREDS_FILE):
            if path.is_file():
                return read_user(path)
    return None


def jetstream_replicas(env: dict[str, str] | None = None) -> int:
    """Copies JetStream keeps of each stream and bucket the mesh creates (KVMESH_JETSTREAM_REPLICAS): 3 on a 3-node
    cluster, so losing a node loses no acknowledged message and the others elect a new leader; 1 on one server.
    Read where a stream is created, not cached: it is a property of the deployment, not of a connection."""
    return load_settings(NatsSettings, env).jetstream_replicas


# How long a JetStream call keeps trying while nobody answers it: a stream's leader was lost and its successor is
# not elected yet, or this connection is moving to another node of the cluster. Elections after a node's SIGKILL
# took 4.5-7.3 s here (tests/integration/test_nats_cluster.py; docs/reliability.md).
ELECTION_BUDGET_S = 15.0
# Errors that are no answer at all (an answer, like "key not found", is never retried)
NO_ANSWER = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
)


async def through_election(call: Callable[[], Awaitable[T]], budget_s: float = ELECTION_BUDGET_S) -> T:
    """`call()`, tried again every so often while JetStream gives no answer (NO_ANSWER), until `budget_s` has
    passed; then its last error. For a call on a request's path that must ride out a leader election: a stored
    response written or read while the node that led its bucket is lost."""
    deadline = time.monotonic() + budget_s
    pause_s = 0.1
    while True:
        try:
            return await call()
        except NO_ANSWER:
            if time.monotonic() + pause_s >= deadline:
                raise
        await asyncio.sleep(pause_s)
        pause_s = min(pause_s * 2, 1.0)


class Bus:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.connected = asyncio.Event()  # set while NATS is reachable; the client's callbacks keep it (`went`)
        if client.is_connected:
            self.connected.set()
        self.num_disconnects = 0

    def went(self, is_connected: bool) -> None:
        """The connection went down (the client reconnects on its own) or came back."""
        if is_connected:
            self.connected.set()
        else:
            self.num_disconnects += 1
            self.connected.clear()

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        timeout_s: float = 5.0,
        user: NatsUser | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> Bus:
        """Connect, failing within `timeout_s` with an error naming the URL; reconnects forever afterwards.

        `user` authenticates unless the URL carries a user:password of its own; `tls` is used when the server
        requires TLS, and for a tls:// URL before any byte is exchanged (the server's `handshake_first`), so a
        server, or anyone between, that does not speak TLS never gets to ask for the password."""
        shown = redact(url)
        refused: list[str] = []

        async def on_error(exc: Exception) -> None:  # one line, not the client's traceback per retry
            if isinstance(exc, nats.errors.Error) and "authorization" in str(exc).lower():
                refused.append(str(exc))
            log.warning("nats error", url=shown, error=f"{type(exc).__name__}: {exc}")

        buses: list[Bus] = []  # the one made below, once the client exists

        async def on_disconnected() -> None:
            log.warning("nats disconnected; reconnecting", url=shown)
            for bus in buses:
                bus.went(False)

        async def on_reconnected() -> None:
            log.info("nats reconnected", url=shown)
            for bus in buses:
                bus.went(True)

        login = {"user": user.user, "password": user.password} if user and not has_userinfo(url) else {}
        try:
            client = await asyncio.wait_for(
                nats.connect(
                    servers(url),
                    name=name,
                    tls=tls,
                    tls_handshake_first=tls is not None and url.startswith("tls://"),
                    **login,
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
        except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
            if refused or isinstance(exc, nats.errors.AuthorizationError):
                raise BusError(
                    f"NATS at {shown} refused this process's credentials ({refused[-1] if refused else exc}): give "
                    "it its role's nats.creds (KVMESH_NATS_CREDS, or KVMESH_TLS_DIR from `kvmesh certs init`)"
                ) from None
            raise BusError(f"cannot reach NATS at {shown}: {exc or type(exc).__name__}") from None
        buses.append(cls(client))
        return buses[0]

    @classmethod
    async def connect_as(cls, role: str, url: str, name: str, credentials: MeshCredentials | None) -> Bus:
        """Connect as `role`'s NATS user (`load_user`), presenting the mesh certificate if NATS asks for TLS.

        Under KVMESH_INSECURE=1 (no `credentials`) a tls:// URL still takes the certificate where there is one: the
        setting opens the roles' gRPC, not a NATS that demands TLS (compose's)."""
        if credentials is None and url.startswith("tls://"):
            try:
                credentials = load_credentials(role, replace(load_settings(TLSSettings), insecure=False))
            except CertificateError:
                credentials = None
        tls = client_ssl_context(credentials) if credentials is not None else None
        return await cls.connect(url, name, user=load_user(role), tls=tls)

    async def publish(self, subject: str, message: Message, request_id: str | None = None) -> None:
        request_id = request_id or current_request_id()
        headers = {REQUEST_ID_KEY: request_id, **trace_headers()} if request_id else trace_headers()
        await self.client.publish(subject, message.SerializeToString(), headers=headers or None)

    async def subscribe(
        self,
        subject: str,
        message_type: type[M],
        handler: Callable[[M, str], Awaitable[None]],
        ignore: Callable[[M], bool] | None = None,
        is_traced: bool = True,
    ) -> Subscription:
        """Call `handler(message, subject)` for each message; undecodable ones are logged and dropped, and those
        `ignore` names (a subscriber's own messages, heard back) are dropped before any span or handler.

        `is_traced`: a message sent inside a trace is handled in a CONSUMER span of it. False for bookkeeping that
        answers no request (a balancer hearing a peer's assignment or a finished request): the trace already
        holds the span that made the event, and a span costs every process's CPU (docs/operations.md)."""

        async def on_message(msg: Msg) -> None:
            message = message_type()
            try:
                message.ParseFromString(msg.data)
            except DecodeError:
                log.warning("undecodable message dropped", subject=msg.subject, type=message_type.__name__)
                return
            if ignore is not None and ignore(message):
                return
            headers = msg.headers or {}
            scope = traced(headers, msg.subject) if is_traced else contextlib.nullcontext()
            with bind_request_id(headers.get(REQUEST_ID_KEY)), scope:
                try:
                    await handler(message, msg.subject)
                except Exception:  # one bad event must not stop the subscription
                    log.exception("event handler failed", subject=msg.subject)

        return await self.client.subscribe(subject, cb=on_message)

    async def flush(self, timeout_s: int = 10) -> None:
        """Wait until the server has seen everything published so far (nats FlushTimeoutError past `timeout_s`)."""
        await self.client.flush(timeout=timeout_s)

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


def traced(headers: dict[str, str], subject: str) -> contextlib.AbstractContextManager[Any]:
    """A message sent inside a trace is handled in a CONSUMER span of it (messaging conventions); others in none."""
    if TRACEPARENT not in headers:
        return contextlib.nullcontext()
    attributes = {"messaging.system": "nats", "messaging.destination.name": subject}
    return span(f"process {subject}", SpanKind.CONSUMER, attributes, context_from(headers))


def decode(message_type: type[M], data: bytes) -> M:
    message = message_type()
    message.ParseFromString(data)
    return message


__all__ = ["Any", "Bus", "BusError", "decode"]
