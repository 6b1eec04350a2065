"""The skeleton every role runs: NATS, a gRPC server, a status server (/healthz, /readyz, /metrics), a
heartbeat, signal handling and a graceful stop (stop taking work, let in-flight work finish, deregister).

    runtime = ServiceRuntime(settings, ROLE_DECODE)
    await runtime.start(register=lambda server: add_DecodeServicer_to_server(servicer, server),
                        models=[...], load=core.load, ready=core.is_ready)
    await runtime.wait_for_stop()
    await runtime.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import grpc
import grpc.aio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mesh import rpc, tls
from mesh.bus import Bus
from mesh.config import ServiceSettings
from mesh.discovery import ROLE_NAMES, Announcer, advertise_host, default_worker_id, now_ms
from mesh.health import HealthServicer
from mesh.logging import configure_logging, get_logger
from mesh.pb import common_pb2, health_pb2_grpc
from mesh.tracing import configure_tracing, shutdown_tracing

log = get_logger(__name__)


class Lifecycle:
    """In-flight work, and whether new work is still taken. Handlers wrap their work in `track()`."""

    def __init__(self) -> None:
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        if self.draining:
            raise rpc.ServiceError(grpc.StatusCode.UNAVAILABLE, "shutting down: not taking new requests")
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work and wait for in-flight work; False if some was still running at the timeout."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


def status_app(ready: Callable[[], bool]) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        return web.Response(text="ready\n") if ready() else web.Response(status=503, text="not ready\n")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


class ServiceRuntime:
    def __init__(self, settings: ServiceSettings, role: common_pb2.Role) -> None:
        self.settings = settings
        self.role = role
        self.role_name = ROLE_NAMES[role]
        self.worker_id = settings.worker_id or default_worker_id(self.role_name)
        self.started_at_ms = now_ms()  # with worker_id, names this process (a restart keeps the id, not this)
        configure_logging(settings.log_level, settings.log_format, role=self.role_name, worker_id=self.worker_id)
        configure_tracing(self.role_name, self.worker_id)  # before the servers: they trace calls only when on
        # before anything else starts: without certificates (or KVMESH_INSECURE=1) the process refuses to run
        self.credentials = tls.load_credentials(self.role_name)
        self.lifecycle = Lifecycle()
        self.channels = rpc.Channels(self.credentials)
        self.bus: Bus | None = None
        self.server: grpc.aio.Server | None = None
        self.grpc_port = 0
        self.http_port = 0
        self._status: web.AppRunner | None = None
        self._announcer: Announcer | None = None
        self._stop = asyncio.Event()
        self.data_address = ""  # host:port of the role's bulk lane, once started with one

    def advertised(self, port: int) -> str:
        """host:port as the other roles dial this process's `port`."""
        host = advertise_host(self.settings.host, self.settings.advertise_host, self.settings.nats_url)
        return f"{host}:{port}"

    @property
    def address(self) -> str:
        return self.advertised(self.grpc_port)

    async def connect_bus(self) -> Bus:
        self.bus = await Bus.connect_as(self.role_name, self.settings.nats_url, self.worker_id, self.credentials)
        return self.bus

    async def start(
        self,
        register: Callable[[grpc.aio.Server], None],
        load: Callable[[], common_pb2.WorkerLoad],
        ready: Callable[[], bool] = lambda: True,
        models: Sequence[str] = (),
        max_num_seqs: int = 0,
        num_kv_blocks: int = 0,
        block_size: int = 0,
        model_block_sizes: Mapping[str, int] | None = None,
        serve_status: bool = True,
        data_port: int = 0,
        public_grpc: bool = False,
        reuse_port: bool = False,
    ) -> None:
        """Serve gRPC and status, then announce (so nobody routes here before we can answer).

        serve_status=False: the role serves /healthz, /readyz and /metrics itself (the gateway's REST app).
        data_port: the port of a bulk lane the role already listens on (mesh.lane), announced beside gRPC's.
        public_grpc: the gRPC server is for clients (the gateway's API): no client certificates, no role checks.
        reuse_port: the public gRPC port is shared with other processes (gateway replicas, SO_REUSEPORT).
        model_block_sizes: each served model's engine block size (the routing keys' block size for that model).
        """
        if self.bus is None:
            await self.connect_bus()
        assert self.bus is not None
        credentials = None if public_grpc else self.credentials
        self.server = rpc.create_public_server(reuse_port) if public_grpc else rpc.create_server(credentials)
        register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(
            HealthServicer(self.worker_id, lambda: not self._stop.is_set()), self.server
        )
        self.grpc_port = rpc.bind(self.server, self.settings.host, self.settings.grpc_port, credentials)
        await self.server.start()
        if serve_status:
            self._status = web.AppRunner(status_app(ready), access_log=None)
            await self._status.setup()
            site = web.TCPSite(self._status, self.settings.host, self.settings.http_port)
            await site.start()
            self.http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.data_address = self.advertised(data_port) if data_port else ""
        info = common_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            address=self.address,
            models=models,  # type: ignore[arg-type]
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            model_block_sizes=model_block_sizes or {},
            data_address=self.data_address,
            started_at_ms=self.started_at_ms,
            version=self.settings.version,
        )
        self._announcer = Announcer(self.bus, info, load, self.settings.heartbeat_interval_s)
        await self._announcer.start()
        self._install_signal_handlers()
        log.info(
            "serving",
            grpc=self.address,
            http_port=self.http_port,
            models=list(models),
            version=self.settings.version,
        )

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stop.set)

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    async def shutdown(
        self,
        before_drain: Callable[[], Awaitable[None]] | None = None,
        after_drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Deregister, stop taking work, let in-flight work finish (up to drain_timeout_s), then close;
        `after_drain` runs while NATS is still connected (e.g. to flush what the finished work published)."""
        log.info("stopping", in_flight=self.lifecycle.in_flight)
        if self._announcer is not None:
            await self._announcer.stop()
        if before_drain is not None:
            await before_drain()
        finished = await self.lifecycle.drain(self.settings.drain_timeout_s)
        if not finished:
            log.warning("drain timed out; cancelling in-flight requests", in_flight=self.lifecycle.in_flight)
        if after_drain is not None:
            await after_drain()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self._status is not None:
            await self._status.cleanup()
        await self.channels.close()
        if self.bus is not None:
            await self.bus.close()
        shutdown_tracing()
        log.info("stopped")
