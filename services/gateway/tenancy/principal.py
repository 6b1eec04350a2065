"""Who a request comes from: the tenant and the key that the auth step resolved, with what they may use.

The contract between the parts of tenancy: the key store resolves a presented key to a Principal; the limiter
reserves against its limits; the ledger records under its ids; the KV cache root is keyed by its tenant.
A Principal never holds the key or the key's hash: it may be logged, put in a trace or a NATS message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_TENANT = "default"  # the tenant of the keys in KVMESH_API_KEYS


@dataclass(frozen=True)
class Limits:
    """What a tenant, or one of its keys, may use. None: no limit of that kind. Token counts are prompt +
    completion tokens; spend is in micro-dollars (integers: sums stay exact)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    spend_per_day_micros: int | None = None
    spend_per_month_micros: int | None = None


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    tenant_name: str
    key_id: str  # the key's public id (`key_...`), never the key
    key_name: str
    tenant_limits: Limits = field(default_factory=Limits)
    key_limits: Limits = field(default_factory=Limits)
    models: frozenset[str] | None = None  # the key's scope: None, every model
    apis: frozenset[str] | None = None  # None, every API (chat.completions, completions, responses, messages, grpc)
    cache_identity: str | None = None  # whose KV it shares (tenancy/cache_salt.py); None: the default tenant's

    def may_use_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def may_use_api(self, api: str) -> bool:
        return self.apis is None or api in self.apis
