"""Resolving a presented tenant key to its Principal, in each gateway replica.

A bounded LRU of resolved digests (a few thousand, each kept `ttl_s`) sits in front of the database; a miss
reads the key's row and its tenant's. Every change to a key or tenant (revocation above all) is published on
TENANCY_CHANGED with the ids only, and every replica drops the affected entries at once, so a revoked key
stops working everywhere within the NATS round trip; the TTL bounds staleness should a message be lost.
Unknown digests are cached too (as None), so guessing keys does not reach the database at request rate. A
database that cannot be read is a 503 (GatewayError), never a 401 for a valid key.

One writer: the KeyStore owns its cache; resolve() and the NATS callback both run on the event loop.
"""

from __future__ import annotations

import hmac
import json
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from mesh.logging import get_logger
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.tenancy.cache_salt import cache_identity
from services.gateway.tenancy.db import Database
from services.gateway.tenancy.keys import is_tenant_key, key_digest, limits_from_json
from services.gateway.tenancy.principal import Principal
from services.gateway.tenancy.schema import api_keys, tenants

log = get_logger(__name__)

# {"tenant_ids": [...], "key_ids": [...]}: which tenants and keys changed; never a key or a digest
TENANCY_CHANGED = "kvmesh.tenancy.changed"


def utc(moment: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes: every time stored here is UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=timezone.utc)


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class _Entry:
    principal: Principal | None  # None: no such key, or revoked
    expires_at: datetime | None  # the key's own expiry, checked at every use
    cached_until: float  # time.monotonic()


class KeyStore:
    def __init__(self, database: Database, secret: bytes, *, ttl_s: float = 10.0, max_entries: int = 4096) -> None:
        self.database = database
        self._secret = secret
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._cache: OrderedDict[str, _Entry] = OrderedDict()  # digest -> entry, least recently used first
        self._generation = 0  # bumped by every forget(): a load that raced one is not cached
        self.num_lookups = 0  # database reads (misses), for tests and stats

    def __repr__(self) -> str:
        return f"KeyStore(num_cached={len(self._cache)})"

    def digest(self, key: str) -> str:
        return key_digest(self._secret, key)

    async def resolve(self, key: str | None) -> Principal | None:
        """The principal of a tenant key; None for any other, unknown, revoked or expired key."""
        if not key or not is_tenant_key(key):
            return None
        digest = self.digest(key)
        entry = self._cache.get(digest)
        if entry is None or entry.cached_until <= time.monotonic():
            entry = await self._load(digest)
        else:
            self._cache.move_to_end(digest)
        if entry.principal is None or (entry.expires_at is not None and entry.expires_at <= now()):
            return None
        return entry.principal

    async def _load(self, digest: str) -> _Entry:
        generation = self._generation
        self.num_lookups += 1
        query = (
            select(
                api_keys,
                tenants.c.name.label("tenant_name"),
                tenants.c.limits.label("tenant_limits"),
                tenants.c.cache_group,
            )
            .join(tenants, tenants.c.id == api_keys.c.tenant_id)
            .where(api_keys.c.digest == digest)
        )
        try:
            async with self.database.engine.connect() as connection:
                row = (await connection.execute(query)).mappings().first()
        except (SQLAlchemyError, OSError) as exc:  # not str(exc): SQLAlchemy's messages carry the digest
            log.warning("the key store cannot be read", error=type(exc).__name__)
            raise GatewayError(ErrorKind.UNAVAILABLE, "API keys cannot be checked right now; retry shortly") from None
        entry = _Entry(_principal(row, digest), utc(row["expires_at"]) if row else None, time.monotonic() + self._ttl_s)
        if generation == self._generation:
            self._cache[digest] = entry
            self._cache.move_to_end(digest)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return entry

    def forget(self, tenant_ids: Iterable[str] = (), key_ids: Iterable[str] = ()) -> None:
        """Drop the entries of these tenants and keys, and every cached unknown (a new key may be among them)."""
        tenant_set, key_set = set(tenant_ids), set(key_ids)
        self._generation += 1
        for digest, entry in list(self._cache.items()):
            principal = entry.principal
            if principal is None or principal.tenant_id in tenant_set or principal.key_id in key_set:
                del self._cache[digest]

    async def follow(self, client: Client) -> None:
        """Forget what other replicas (and this one) announce as changed."""

        async def on_change(msg: Msg) -> None:
            try:
                change = json.loads(msg.data)
                self.forget(change.get("tenant_ids", ()), change.get("key_ids", ()))
            except (ValueError, AttributeError, TypeError):
                log.warning("malformed tenancy change dropped", subject=msg.subject)

        await client.subscribe(TENANCY_CHANGED, cb=on_change)


def _principal(row: Any, digest: str) -> Principal | None:
    if row is None or not hmac.compare_digest(row["digest"], digest) or row["revoked_at"] is not None:
        return None
    return Principal(
        tenant_id=row["tenant_id"],
        tenant_name=row["tenant_name"],
        key_id=row["id"],
        key_name=row["name"],
        tenant_limits=limits_from_json(row["tenant_limits"], "tenant.limits"),
        key_limits=limits_from_json(row["limits"], "key.limits"),
        models=None if row["models"] is None else frozenset(row["models"]),
        apis=None if row["apis"] is None else frozenset(row["apis"]),
        cache_identity=cache_identity(row["tenant_id"], row["cache_group"]),
    )


async def publish_change(client: Client | None, tenant_ids: Iterable[str] = (), key_ids: Iterable[str] = ()) -> None:
    """Tell every replica (this one included) to forget these tenants and keys."""
    if client is None:
        return
    payload = {"tenant_ids": sorted(tenant_ids), "key_ids": sorted(key_ids)}
    await client.publish(TENANCY_CHANGED, json.dumps(payload).encode())
    await client.flush()
