"""The gateway process: load the models' tokenizers, follow the mesh's heartbeats, serve the REST API on
http_port (with /healthz, /readyz, /metrics) and the Gateway gRPC service on grpc_port, announce itself as
ROLE_GATEWAY, and stop gracefully (deregister, refuse new requests, let in-flight ones finish)."""

from __future__ import annotations

import asyncio

from mesh.discovery import KnownWorker, WorkerRegistry
from mesh.logging import get_logger
from mesh.pb import common_pb2, gateway_pb2_grpc
from mesh.rollouts import RolloutStore
from mesh.service import ServiceRuntime, status_app
from services.gateway.auth import KeyRing
from services.gateway.catalog import ModelCatalog
from services.gateway.config import GatewaySettings
from services.gateway.core import GatewayCore
from services.gateway.grpc_api import GatewayServicer
from services.gateway.http_app import create_app
from services.gateway.image_encoding import ImageEncoding
from services.gateway.listener import Listener
from services.gateway.mesh_view import FOLLOWED_ROLES, MeshView
from services.gateway.pipeline import Pipeline
from services.gateway.quality_probe import QualityProbe, RolloutProbes
from services.gateway.response_store import ResponseStore
from services.gateway.telemetry import TENANT_LABELS
from services.gateway.tenancy.abandoned import AbandonedRequests
from services.gateway.tenancy.admin_api import Admin
from services.gateway.tenancy.db import Database, open_database
from services.gateway.tenancy.keys import server_secret
from services.gateway.tenancy.ledger import LedgerConsumer, UsagePublisher
from services.gateway.tenancy.limits import Limiter
from services.gateway.tenancy.spend import PriceBook
from services.gateway.tenancy.store import KeyStore

log = get_logger(__name__)
ABANDONED_MARGIN_S = 60.0  # past request_timeout_s, an open request is settled even if its gateway seems alive


class GatewayServer:
    """start() / stop() for tests and embedding; `serve` runs one until SIGTERM or SIGINT."""

    def __init__(self, settings: GatewaySettings, catalog: ModelCatalog | None = None) -> None:
        self.settings = settings
        self.runtime = ServiceRuntime(settings, common_pb2.ROLE_GATEWAY)
        self._catalog = catalog
        self.registry: WorkerRegistry | None = None
        self.core: GatewayCore | None = None
        self.http_port = 0
        self._http: Listener | None = None
        self.metrics_port = -1  # the keyless /metrics port (setting metrics_port), once bound; -1: none
        self._metrics: Listener | None = None
        self.database: Database | None = None  # tenants, keys, prices, usage (tenancy/db.py)
        self.limiter: Limiter | None = None
        self.prices: PriceBook | None = None
        self.ledger: UsagePublisher | None = None
        self.ledger_consumer: LedgerConsumer | None = None  # one of the replicas' shared `ledger` consumer
        self.gateways: WorkerRegistry | None = None  # every gateway process, for AbandonedRequests
        self.abandoned: AbandonedRequests | None = None
        self.probes: RolloutProbes | None = None  # canary rollouts' quality probes

    @property
    def grpc_port(self) -> int:
        return self.runtime.grpc_port

    async def start(self) -> None:
        settings = self.settings
        catalog = self._catalog
        if catalog is None:  # opening a GGUF's metadata takes seconds: off the event loop
            catalog = await asyncio.to_thread(ModelCatalog.load, settings.models)
        bus = await self.runtime.connect_bus()
        TENANT_LABELS.capacity = settings.metrics_named_tenants
        self.database = await open_database(settings)
        secret = server_secret(settings)
        key_store = KeyStore(self.database, secret)
        await key_store.follow(bus.client)  # revocations from every replica
        self.ledger = UsagePublisher(
            bus,
            gateway=(self.runtime.worker_id, self.runtime.started_at_ms),
            settle_after_s=settings.request_timeout_s + ABANDONED_MARGIN_S,
        )
        await self.ledger.start()
        self.ledger_consumer = LedgerConsumer(bus, self.database)
        await self.ledger_consumer.start()
        self.gateways = WorkerRegistry(bus, (common_pb2.ROLE_GATEWAY,), settings.heartbeat_interval_s)
        await self.gateways.start()
        self.abandoned = AbandonedRequests(
            bus, self.database, self._live_gateways, warmup_s=3 * settings.heartbeat_interval_s + 1
        )
        await self.abandoned.start()
        self.registry = WorkerRegistry(
            bus,
            FOLLOWED_ROLES,
            settings.heartbeat_interval_s,
            on_leave=self._forget_worker,
            eject_after_failures=settings.eject_after_failures,
        )
        self.registry.check_health(
            self.runtime.channels, settings.health_check_interval_s, settings.health_check_timeout_s
        )
        self.registry.export_metrics()
        await self.registry.start()
        self.prices = PriceBook(self.database)  # spend budgets' prices at admission
        await self.prices.start()
        self.limiter = Limiter(
            bus.client,
            fail_open=settings.limits_fail_open,
            lease_s=settings.limits_lease_s,
            prices=self.prices,
            allowance_requests=settings.limits_allowance_requests,
        )
        self.limiter.start()
        self.probes = RolloutProbes(RolloutStore(bus.client), QualityProbe(self.registry, self.runtime.channels))
        await self.probes.start()
        # a stream on a worker out for failed checks, with no token for as long as those checks took, moves
        check_round_s = settings.health_check_timeout_s + settings.health_check_interval_s
        mesh = MeshView(
            self.registry, settings.slow_decode, unrouted_stall_s=settings.eject_after_failures * check_round_s
        )
        self.core = GatewayCore(
            keys=KeyRing(settings.api_keys),
            key_store=key_store,
            catalog=catalog,
            mesh=mesh,
            pipeline=Pipeline(self.runtime.channels, mesh, settings.block_size, settings.max_retries),
            lifecycle=self.runtime.lifecycle,
            request_timeout_s=settings.request_timeout_s,
            images=ImageEncoding(settings.image_settings, self.registry, self.runtime.channels, settings.max_retries),
            limiter=self.limiter,
            ledger=self.ledger,
            cache_secret=secret,
            output_limits=settings.output_limits,
            worker_id=self.runtime.worker_id,
        )
        admin = Admin(settings.admin_key, self.database, secret, key_store, bus.client)
        app = create_app(self.core, ResponseStore(bus.client), admin, public_metrics=settings.public_metrics)
        if settings.public_metrics:
            log.warning("public_metrics: /metrics answers anyone on the public port (tenant names and traffic)")
        limits = settings.listener_limits
        self._http = await Listener.start(app, settings.host, settings.http_port, limits, settings.reuse_port)
        self.http_port = self._http.port
        if settings.metrics_port >= 0:  # scrapers on a private network: no key
            self._metrics = await Listener.start(
                status_app(self.core.is_ready), settings.host, settings.metrics_port, limits
            )
            self.metrics_port = self._metrics.port
        servicer = GatewayServicer(self.core)
        await self.runtime.start(
            register=lambda server: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server),
            load=self._load,
            ready=self.core.is_ready,
            models=catalog.names,
            serve_status=False,
            public_grpc=True,  # API keys guard the Gateway service, not client certificates
            reuse_port=settings.reuse_port,
        )  # the REST app serves /healthz, /readyz and /metrics on http_port itself
        log.info("gateway serving", http_port=self.http_port, grpc_port=self.grpc_port, models=catalog.names)

    def _forget_worker(self, worker: KnownWorker) -> None:
        """A worker left the mesh for good: its latency samples and ejections go too."""
        if self.core is not None:
            self.core.mesh.latency.forget(worker.worker_id)

    def _live_gateways(self) -> set[tuple[str, int]]:
        """The gateway processes heard from lately, this one included (abandoned.py)."""
        assert self.gateways is not None
        live = {(w.worker_id, w.info.started_at_ms) for w in self.gateways.workers()}
        return live | {(self.runtime.worker_id, self.runtime.started_at_ms)}

    def _load(self) -> common_pb2.WorkerLoad:
        return common_pb2.WorkerLoad(num_running=self.runtime.lifecycle.in_flight)

    async def stop(self) -> None:
        async def stop_following() -> None:
            if self.probes is not None:
                await self.probes.stop()
            if self.registry is not None:
                await self.registry.stop()
            if self.abandoned is not None:
                await self.abandoned.stop()
            if self.gateways is not None:
                await self.gateways.stop()

        async def flush_usage() -> None:  # the finished requests' records, while NATS is still there
            if self.limiter is not None:  # settlements first: they release what the finished requests held
                await self.limiter.stop()
            if self.prices is not None:
                await self.prices.stop()
            if self.ledger is not None:
                await self.ledger.close()
            if self.ledger_consumer is not None:  # after the flush: this replica may write its own last records
                await self.ledger_consumer.stop()

        await self.runtime.shutdown(before_drain=stop_following, after_drain=flush_usage)
        for listener in (self._http, self._metrics):
            if listener is not None:
                await listener.stop()
        if self.database is not None:
            await self.database.close()


async def serve(settings: GatewaySettings) -> None:
    server = GatewayServer(settings)
    await server.start()
    try:
        await server.runtime.wait_for_stop()
    finally:
        await server.stop()
