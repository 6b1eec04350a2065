"""Typed service configuration from the environment: every field `foo` of a settings dataclass is read from
`KVMESH_FOO`. A bad value fails at start with an error naming the variable. Each field carries its meaning
(`setting(default, "meaning")`), from which `kvmesh config --markdown` writes docs/configuration.md.

    @dataclass(frozen=True)
    class DecodeSettings(ServiceSettings):
        models: tuple[str, ...] = setting(("smollm2-135m",), "served models")

    settings = load_settings(DecodeSettings)             # from os.environ
    settings = load_settings(DecodeSettings, grpc_port=0)  # explicit values win over the environment
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

ENV_PREFIX = "KVMESH_"
try:
    PACKAGE_VERSION = importlib.metadata.version("kvmesh")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    PACKAGE_VERSION = "unknown"
T = TypeVar("T")
DOC = "doc"  # the metadata key of a setting's meaning


def setting(default: T, doc: str, *, secret: bool = False) -> T:
    """A settings field with its meaning (metadata["doc"]); a secret stays out of repr."""
    return dataclasses.field(default=default, repr=not secret, metadata={DOC: doc})


@dataclass(frozen=True)
class EnvVariable:
    """A KVMESH_* variable read outside the settings dataclasses (docs/configuration.md lists these too)."""

    name: str
    roles: str  # who reads it, in words
    default: str
    doc: str


OTHER_VARIABLES: tuple[EnvVariable, ...] = (
    EnvVariable(
        "KVMESH_MODEL_DIR",
        "gateway, encoder, prefill, decode, `kvmesh models`",
        "`~/.cache/kvmesh/models`",
        "where known models are stored, one directory per name (`engine_core.model_store`)",
    ),
    EnvVariable(
        "KVMESH_API_KEY",
        "`kvmesh bench serve`",
        "(none: the key of the mesh it starts)",
        "the API key to send to a gateway given by `--url` (`--api-key` wins); never printed",
    ),
)


class SettingError(ValueError):
    """A setting that cannot be used; the message names the environment variable."""


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _parse(raw: str, kind: Any, name: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):  # X | None: empty means None
        inner = [k for k in typing.get_args(kind) if k is not type(None)]
        return None if raw.strip() == "" else _parse(raw, inner[0], name)
    if origin is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return lowered in ("1", "true", "yes", "on")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    return raw


def load_settings(cls: type[T], env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build `cls` from KVMESH_* variables, then `overrides` (None values in overrides are ignored)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = env_name(field.name)
        if name in env:
            values[field.name] = _parse(env[name], hints[field.name], name)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise SettingError(f"unknown settings: {', '.join(sorted(unknown))}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def require(condition: bool, field_name: str, value: Any, expectation: str) -> None:
    """For __post_init__ checks: fail naming the variable."""
    if not condition:
        raise SettingError(f"{env_name(field_name)}={value!r}: {expectation}")


def require_data_port(port: int) -> None:
    """A bulk lane's port (mesh.lane): KVMESH_DATA_PORT, on the roles that have one."""
    require(-1 <= port < 65536, "data_port", port, "must be a port number (0 for any free port, -1 for no bulk lane)")


@dataclass(frozen=True)
class LaneSettings:
    """What bounds a bulk lane's listener (mesh.lane), on the roles that have one: their settings add these fields
    (`class KVCacheSettings(ServiceSettings, LaneSettings)`) and call `check_lane_settings` after their own checks."""

    lane_max_connections: int = setting(512, "bulk lane: connections held at once; past it a new one is closed")
    lane_max_connections_per_peer: int = setting(
        64, "bulk lane: connections held at once from one peer address; past it a new one is closed"
    )
    lane_handshake_timeout_s: float = setting(
        5.0, "bulk lane: seconds a new connection has to finish its TLS handshake"
    )
    lane_idle_timeout_s: float = setting(60.0, "bulk lane: seconds a connection may wait between exchanges")
    lane_read_timeout_s: float = setting(
        30.0, "bulk lane: seconds a started exchange may go without a byte moving either way"
    )
    lane_exchange_timeout_s: float = setting(
        120.0, "bulk lane: seconds from an exchange's first frame to its end (an unfinished write is then dropped)"
    )
    lane_max_write_bytes: int = setting(
        2**30, "bulk lane: bytes one write to a store node may carry before its end frame; past it the write is refused"
    )
    lane_encrypt: bool = setting(
        True,
        "bulk lane: encrypt KV on the wire (AES-GCM); false: authenticate it only (a GMAC per frame, faster, the KV "
        "readable on the wire; logs a warning)",
    )

    def __post_init__(self) -> None:
        check_lane_settings(self)


def check_lane_settings(settings: LaneSettings) -> None:
    for field in dataclasses.fields(LaneSettings):
        value = getattr(settings, field.name)
        if not isinstance(value, bool):
            require(value > 0, field.name, value, "must be positive")


@dataclass(frozen=True)
class ServiceSettings:
    """What every role reads. Roles subclass it with their own fields."""

    nats_url: str = setting("nats://127.0.0.1:4222", "the NATS bus (`kvmesh up` starts its own)")
    host: str = setting("127.0.0.1", "the interface the servers bind to")
    advertise_host: str = setting(
        "", "the address other roles dial (empty: the host; for 0.0.0.0, this process's address towards NATS)"
    )
    grpc_port: int = setting(0, "the gRPC port (0: any free port; it is announced, so nobody needs it in advance)")
    http_port: int = setting(0, "the port of /healthz, /readyz and /metrics (0: any free port)")
    worker_id: str = setting("", "the name in pools, headers and metrics (empty: `<role>-<host>-<pid>`)")
    heartbeat_interval_s: float = setting(
        1.0, "seconds between heartbeats; a worker silent for 3 while NATS is up, and failing health checks, leaves"
    )
    health_check_interval_s: float = setting(
        0.5, "seconds between gRPC health checks of each known worker by gateways and balancers (0: none)"
    )
    health_check_timeout_s: float = setting(
        0.5, "the deadline of one gRPC health check (seconds); lateness never ejects a role's last pooled worker"
    )
    eject_after_failures: int = setting(
        3, "consecutive failed calls or health checks that eject a worker from its pools (until it answers again)"
    )
    outbox_size: int = setting(
        10_000,
        "events kept per outbox while NATS is away (KV events, finished requests), sent in order when it returns; "
        "beyond: a store node resyncs, others drop the oldest",
    )
    log_level: str = setting("info", "debug, info, warning or error (structlog)")
    log_format: str = setting("auto", "auto (JSON unless a terminal), json or console")
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long in-flight requests may finish (seconds)")
    version: str = setting(
        PACKAGE_VERSION, "the version this worker announces in its heartbeat (a rollout splits traffic by it)"
    )

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            value = getattr(self, name)
            require(0 <= value < 65536, name, value, "must be a port number (0 for any free port)")
        require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", self.heartbeat_interval_s, "must be positive")
        require(self.drain_timeout_s >= 0, "drain_timeout_s", self.drain_timeout_s, "must not be negative")
        require(
            self.health_check_interval_s >= 0,
            "health_check_interval_s",
            self.health_check_interval_s,
            "must not be negative",
        )
        require(
            self.health_check_timeout_s > 0, "health_check_timeout_s", self.health_check_timeout_s, "must be positive"
        )
        require(self.eject_after_failures >= 1, "eject_after_failures", self.eject_after_failures, "must be at least 1")
        require(self.outbox_size >= 1, "outbox_size", self.outbox_size, "must be at least 1")
        require(self.version.strip() != "", "version", self.version, "must not be empty")
        require(
            self.log_format in ("auto", "json", "console"),
            "log_format",
            self.log_format,
            "must be auto, json or console",
        )
        require(
            self.log_level.lower() in ("debug", "info", "warning", "error"),
            "log_level",
            self.log_level,
            "must be debug, info, warning or error",
        )
        require(
            self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")),
            "nats_url",
            self.nats_url,
            "must be a nats:// URL",
        )


@dataclass(frozen=True)
class TLSSettings:
    """Mutual TLS between the roles (mesh.tls): read from the environment by every process that serves or dials
    the mesh's internal gRPC, whatever its role's settings (so `kvmesh up`, compose and the tools agree)."""

    tls_dir: str = setting(
        "",
        "a directory with ca.pem and this process's <role>.pem and <role>-key.pem (or <role>/ holding them); "
        "`kvmesh certs init DIR` writes one",
    )
    tls_cert: str = setting("", "this process's certificate (PEM); with TLS_KEY and TLS_CA it wins over TLS_DIR")
    tls_key: str = setting("", "this process's private key (PEM); never logged")
    tls_ca: str = setting("", "the mesh's CA certificate (PEM) that every peer's certificate must chain to")
    insecure: bool = setting(
        False, "plaintext internal gRPC without identities (development only: every process logs a warning)"
    )

    def __post_init__(self) -> None:
        explicit = [name for name in ("tls_cert", "tls_key", "tls_ca") if getattr(self, name)]
        require(
            len(explicit) in (0, 3),
            explicit[0] if explicit else "tls_cert",
            "<path>",
            "set KVMESH_TLS_CERT, KVMESH_TLS_KEY and KVMESH_TLS_CA together (or KVMESH_TLS_DIR)",
        )


@dataclass(frozen=True)
class NatsSettings:
    """How a process proves who it is to NATS (mesh.bus): read by every process that joins the bus, like
    TLSSettings. A `tls://` KVMESH_NATS_URL also makes a role present its mesh certificate to NATS."""

    nats_creds: str = setting(
        "",
        "a file with this process's NATS user and password (`kvmesh certs init` writes <role>/nats.creds); empty: "
        "nats.creds in KVMESH_TLS_DIR (or its <role>/), else user:password in KVMESH_NATS_URL; never logged",
    )
    jetstream_replicas: int = setting(
        1,
        "copies JetStream keeps of the streams and buckets a role creates (KV events, usage, Responses store, "
        "...): 1 on one NATS server, 3 on a 3-node cluster (`kvmesh up --nats-cluster 3` sets it); 1 to 5",
    )

    def __post_init__(self) -> None:
        require(
            1 <= self.jetstream_replicas <= 5,
            "jetstream_replicas",
            self.jetstream_replicas,
            "must be 1 to 5 (JetStream's limit), and at most the NATS cluster's size",
        )


def process_variables(cls: type, roles: str) -> tuple[EnvVariable, ...]:
    """The fields of a settings class read by every process (not one role's class) as OTHER_VARIABLES rows."""
    rows = []
    for field in dataclasses.fields(cls):
        default = field.default
        shown = (
            "(none)" if default in ("", ()) else f"`{str(default).lower() if isinstance(default, bool) else default}`"
        )
        rows.append(EnvVariable(env_name(field.name), roles, shown, field.metadata[DOC]))
    return tuple(rows)


OTHER_VARIABLES += process_variables(TLSSettings, "every role, `kvmesh up` and the benchmarks that start roles")
OTHER_VARIABLES += process_variables(NatsSettings, "every role")
