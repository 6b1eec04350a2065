"""The gateway's settings: every field `foo` is read from `KVMESH_FOO` (see mesh.config)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core import model_store
from engine_core.images import ImageLimits
from mesh.config import ServiceSettings, require, setting
from mesh.latency_outliers import LatencyRule
from services.gateway.egress import EgressGuard
from services.gateway.images import ImageSettings
from services.gateway.listener import ListenerLimits
from services.gateway.output_limits import OutputLimits, parse_per_model


@dataclass(frozen=True)
class GatewaySettings(ServiceSettings):
    http_port: int = setting(8080, "the REST API, with /healthz, /readyz and /metrics (the admin key's) beside it")
    grpc_port: int = setting(50050, "the Gateway gRPC service")
    reuse_port: bool = setting(
        False,
        "bind http_port and grpc_port with SO_REUSEPORT, so several gateway processes share them and the kernel "
        "spreads connections (`kvmesh up --gateway N` sets it)",
    )
    # Never printed: kept out of repr, and auth.KeyRing holds only digests.
    api_keys: tuple[str, ...] = setting(
        (), "accepted API keys, comma-separated (`kvmesh up` generates one when unset)", secret=True
    )
    models: tuple[str, ...] = setting(model_store.DEFAULT_MODELS, "served models, whose tokenizers it loads")
    block_size: int = setting(
        16,
        "tokens per block of a model's routing keys until its workers announce that model's own (its engine's)",
    )
    max_retries: int = setting(
        2, "re-routes (and migrations) after a worker fails with UNAVAILABLE or RESOURCE_EXHAUSTED"
    )
    # a slow decode worker (mesh/latency_outliers.py): ejected from routing for a while, its late streams migrated
    slow_decode_factor: float = setting(
        3.0,
        "a decode worker whose time per token (its streams' gaps over their tokens) is over this many times its "
        "pool's others' is ejected from routing, and its streams whose next token is this late migrate (0: never)",
    )
    slow_decode_window_s: float = setting(5.0, "seconds of inter-token latency samples a decode worker is judged on")
    slow_decode_min_samples: int = setting(
        8, "samples a decode worker (and a worker it is compared with) needs in the window to be judged"
    )
    slow_decode_ejection_s: float = setting(
        10.0, "seconds a slow decode worker stays out of routing; each ejection in a row adds as much (up to 10x)"
    )
    slow_decode_min_itl_s: float = setting(
        0.005, "a time per token below this (seconds) is never slow: the gateway's own loop jitter"
    )
    request_timeout_s: float = setting(600.0, "arrival to last token, in seconds; past it the request fails with 504")
    # output length (services/gateway/output_limits.py), for every API: N, model=N, or both (N for the others)
    default_max_tokens: tuple[str, ...] = setting(
        ("4096",),
        "output tokens of a request that sets no max_tokens (max_completion_tokens, max_output_tokens), cut to "
        "what the context leaves; per model as `N,model=M`; 0: the rest of the context",
    )
    max_output_tokens: tuple[str, ...] = setting(
        ("0",),
        "the most output tokens a request may ask for (more is a 400 naming its field); per model as "
        "`N,model=M`; 0: the context is the only bound",
    )
    # images in chat messages (services/gateway/images.py): checked here, encoded by the encoder pool
    max_images_per_request: int = setting(4, "images in one request; more is a 400 (0: no images)")
    max_image_bytes: int = setting(
        6 * 2**20, "an image's bytes after base64 (the whole body is at most 8 MiB); more is a 400 naming it"
    )
    max_image_side: int = setting(
        4096, "an image's width or height in pixels; more is refused naming it (at the gateway: a 400)"
    )
    max_image_pixels: int = setting(
        4096 * 4096, "an image's width x height; more is refused naming it (at the gateway: a 400)"
    )
    allow_remote_images: bool = setting(
        False, "fetch http(s) image URLs: public addresses only (egress guard), no redirects, size and time limits"
    )
    image_fetch_timeout_s: float = setting(10.0, "seconds to fetch one remote image")
    image_fetch_allow_private: bool = setting(
        False,
        "let remote image fetches reach loopback, private, link-local and metadata addresses (tests and trusted "
        "on-premises image hosts only; logs a warning)",
    )
    # tenant and key limits (services/gateway/tenancy/limits.py), counted in the NATS KV bucket KVMESH_LIMITS
    limits_fail_open: bool = setting(
        False, "admit requests uncounted (logging a warning) when the limit counters cannot be reached; else a 503"
    )
    limits_lease_s: float = setting(
        30.0, "a concurrency slot's lease: renewed while its request runs, freed this long after its gateway dies"
    )
    limits_allowance_requests: int = setting(
        32,
        "room for this many requests drawn from a roomy limit ahead of need, so most admissions need no store "
        "round trip (grows when it runs short; exact either way); 0: every admission a compare-and-set",
    )
    # tenancy (services/gateway/tenancy/): tenants, keys, prices and the usage ledger live in one database
    database_url: str = setting(
        "", "the tenancy database: postgresql://... (asyncpg) or sqlite:///path (empty: SQLite kvmesh.db in state_dir)"
    )
    state_dir: str = setting("~/.local/share/kvmesh", "the gateway's files: the SQLite database, the server secret")
    server_secret: str = setting(
        "",
        "HMAC secret for stored API key digests and KV cache roots; replicas must share it "
        "(empty: one generated once in <state_dir>/server_secret)",
        secret=True,
    )
    metrics_named_tenants: int = setting(
        20, "tenants named in the gateway's metrics' `tenant` label: the busiest; the rest are `other`"
    )
    admin_key: str = setting(
        "", "the key of /admin/v1/ (`kvmesh up` generates one when unset; empty: admin routes are off)", secret=True
    )
    metrics_port: int = setting(
        -1,
        "a second port serving /metrics, /healthz and /readyz with no key, for scrapers on a private network "
        "(-1: none, 0: any free port); on the public port /metrics needs the admin key",
    )
    max_connections: int = setting(4096, "open connections to the public port, in all (0: no cap); more are closed")
    max_connections_per_client: int = setting(
        256, "open connections from one client address (0: no cap; behind a proxy every client shares its address)"
    )
    head_timeout_s: float = setting(10.0, "seconds from a connection's accept to the end of its first request head")
    keepalive_timeout_s: float = setting(75.0, "seconds an idle kept-alive connection stays open")
    public_metrics: bool = setting(
        False, "serve /metrics on the public port with no key (tenant names and traffic to anyone; logs a warning)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.api_keys), "api_keys", "", "set at least one API key (comma-separated)")
        require(
            all(key.strip() == key and key for key in self.api_keys),
            "api_keys",
            "<hidden>",
            "keys must be non-empty and without surrounding spaces",
        )
        require(bool(self.models), "models", self.models, "name at least one model")
        require(self.block_size > 0, "block_size", self.block_size, "must be positive")
        require(self.max_retries >= 0, "max_retries", self.max_retries, "must not be negative")
        for name in ("max_connections", "max_connections_per_client"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must not be negative (0: no cap)")
        for name in ("head_timeout_s", "keepalive_timeout_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be positive")
        require(self.metrics_port >= -1, "metrics_port", self.metrics_port, "must be -1 (none), 0 (any) or a port")
        require(self.request_timeout_s > 0, "request_timeout_s", self.request_timeout_s, "must be positive")
        for name in ("default_max_tokens", "max_output_tokens"):
            try:
                parse_per_model(getattr(self, name), name)
            except ValueError as exc:
                require(False, name, ",".join(getattr(self, name)), str(exc).removeprefix(f"{name}: "))
        require(self.limits_lease_s >= 1, "limits_lease_s", self.limits_lease_s, "must be at least 1 second")
        require(
            self.limits_allowance_requests >= 0,
            "limits_allowance_requests",
            self.limits_allowance_requests,
            "must not be negative (0: no allowances)",
        )
        require(
            self.metrics_named_tenants >= 0, "metrics_named_tenants", self.metrics_named_tenants, "must not be negative"
        )
        for name in ("max_image_bytes", "max_image_side", "max_image_pixels", "image_fetch_timeout_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be positive")
        require(
            self.max_images_per_request >= 0,
            "max_images_per_request",
            self.max_images_per_request,
            "must not be negative (0: no images)",
        )
        self._check_slow_decode()

    def _check_slow_decode(self) -> None:
        """LatencyRule checks its fields, naming the one at fault: said again naming its variable."""
        try:
            _ = self.slow_decode
        except ValueError as exc:
            field, _, reason = str(exc).partition(": ")
            name = "slow_decode_" + field.split("=")[0]
            require(False, name, getattr(self, name), reason)

    @property
    def slow_decode(self) -> LatencyRule:
        return LatencyRule(
            self.slow_decode_factor,
            self.slow_decode_window_s,
            self.slow_decode_min_samples,
            self.slow_decode_ejection_s,
            self.slow_decode_min_itl_s,
        )

    @property
    def output_limits(self) -> OutputLimits:
        return OutputLimits(
            parse_per_model(self.default_max_tokens, "default_max_tokens"),
            parse_per_model(self.max_output_tokens, "max_output_tokens"),
        )

    @property
    def listener_limits(self) -> ListenerLimits:
        return ListenerLimits(
            self.max_connections, self.max_connections_per_client, self.head_timeout_s, self.keepalive_timeout_s
        )

    @property
    def image_settings(self) -> ImageSettings:
        limits = ImageLimits(self.max_image_bytes, self.max_image_side, self.max_image_pixels)
        return ImageSettings(
            limits,
            self.max_images_per_request,
            self.allow_remote_images,
            self.image_fetch_timeout_s,
            EgressGuard(allow_private=self.image_fetch_allow_private),
        )
