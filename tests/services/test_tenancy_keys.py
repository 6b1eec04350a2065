"""Tenant keys: made random and shown once, stored as an HMAC under the server secret, resolved by each gateway
replica through a bounded cache that a revocation on NATS clears at once (on SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import aiohttp
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from kvmesh.nats_server import EmbeddedNats
from mesh.config import load_settings
from services.gateway.api_models.admin import KeyCreate, LimitsBody, TenantCreate
from services.gateway.catalog import ModelCatalog
from services.gateway.config import GatewaySettings
from services.gateway.errors import GatewayError
from services.gateway.server import GatewayServer
from services.gateway.tenancy import accounts
from services.gateway.tenancy import store as store_module
from services.gateway.tenancy.db import Database, open_database
from services.gateway.tenancy.keys import key_digest, limits_from_json, new_key, server_secret
from services.gateway.tenancy.principal import Limits, Principal
from services.gateway.tenancy.schema import api_keys
from services.gateway.tenancy.store import KeyStore

from .tenancy_databases import BACKENDS, empty_database_url

SECRET = b"test-server-secret"


def _settings(**overrides: object) -> GatewaySettings:
    return load_settings(GatewaySettings, env={}, **{"api_keys": ("sk-env",), **overrides})


def test_keys_are_prefixed_random_and_stored_as_a_keyed_hash() -> None:
    keys = {new_key() for _ in range(1000)}
    assert len(keys) == 1000
    key = next(iter(keys))
    assert key.startswith("sk-kvm-") and len(key) == 7 + 32  # 24 random bytes in base64url: 192 bits
    digest = key_digest(SECRET, key)
    assert len(digest) == 64 and digest == key_digest(SECRET, key)
    assert digest != key_digest(b"another secret", key)  # a stolen table is useless without the secret


def test_the_server_secret_is_made_once_private_and_shared_by_later_starts(tmp_path: Path) -> None:
    settings = _settings(state_dir=str(tmp_path))
    first = server_secret(settings)
    assert len(first) == 64 and server_secret(settings) == first
    assert stat.S_IMODE(os.stat(tmp_path / "server_secret").st_mode) == 0o600
    assert list(tmp_path.iterdir()) == [tmp_path / "server_secret"]  # no draft left behind
    assert server_secret(_settings(state_dir=str(tmp_path), server_secret="set")) == b"set"


def test_stored_limits_are_read_strictly_naming_the_field() -> None:
    assert limits_from_json({"requests_per_minute": 5}, "limits") == Limits(requests_per_minute=5)
    with pytest.raises(ValueError, match=r"^limits\.rpm: unknown limit"):
        limits_from_json({"rpm": 5}, "limits")
    with pytest.raises(ValueError, match=r"^limits\.max_concurrent: must be a non-negative integer or null, not -1"):
        limits_from_json({"max_concurrent": -1}, "limits")
    with pytest.raises(ValueError, match=r"^limits: must be an object"):
        limits_from_json([1], "limits")


async def _tenant_and_key(database, **key_fields):  # type: ignore[no-untyped-def]
    tenant = await accounts.create_tenant(
        database, TenantCreate(name="acme", limits=LimitsBody(tokens_per_minute=2000), price_plan="gold")
    )
    body = KeyCreate.model_validate({"tenant": tenant["id"], "name": "ci", **key_fields})
    row, key = await accounts.create_key(database, SECRET, body)
    return tenant, row, key


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_key_resolves_through_the_cache_until_revoked(backend: str, tmp_path: Path) -> None:
    async with empty_database_url(backend, tmp_path) as url:
        database = await open_database(_settings(database_url=url))
        try:
            tenant, row, key = await _tenant_and_key(
                database, models=["smollm2-135m"], apis=["responses", "chat.completions"], limits={"max_concurrent": 2}
            )
            store = KeyStore(database, SECRET)
            expected = Principal(
                tenant_id=tenant["id"],
                tenant_name="acme",
                key_id=row["id"],
                key_name="ci",
                tenant_limits=Limits(tokens_per_minute=2000),
                key_limits=Limits(max_concurrent=2),
                models=frozenset({"smollm2-135m"}),
                apis=frozenset({"chat.completions", "responses"}),
                cache_identity=f"tenant:{tenant['id']}",
            )
            assert await store.resolve(key) == expected
            assert await store.resolve(key) == expected
            assert store.num_lookups == 1  # the second use came from the cache
            assert await store.resolve(key + "x") is None
            assert await store.resolve("sk-env") is None  # not a tenant key's shape: never looked up
            assert await store.resolve(None) is None
            assert store.num_lookups == 2
            # the digest is what the database holds, never the key
            async with database.engine.connect() as connection:
                stored = (await connection.execute(api_keys.select())).mappings().one()
            assert stored["digest"] == key_digest(SECRET, key) and key not in str(dict(stored))
            revoked = await accounts.revoke_key(database, row["id"])
            assert revoked["revoked_at"] is not None and "digest" not in revoked
            assert await store.resolve(key) == expected  # cached: until a change is announced
            store.forget(key_ids=[row["id"]])
            assert await store.resolve(key) is None
            again = await accounts.revoke_key(database, row["id"])
            assert again["revoked_at"] == revoked["revoked_at"]  # revoking twice keeps the first time
        finally:
            await database.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_expired_key_stops_at_its_expiry_even_when_cached(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with empty_database_url(backend, tmp_path) as url:
        database = await open_database(_settings(database_url=url))
        try:
            expiry = datetime.now(timezone.utc) + timedelta(hours=1)
            _, row, key = await _tenant_and_key(database, expires_at=expiry.isoformat())
            assert row["expires_at"] == expiry.isoformat()
            store = KeyStore(database, SECRET)
            assert (await store.resolve(key)) is not None
            # the store's wall clock moved, not the test's: a loaded machine cannot make the key expire early
            monkeypatch.setattr(store_module, "now", lambda: expiry - timedelta(microseconds=1))
            assert (await store.resolve(key)) is not None
            monkeypatch.setattr(store_module, "now", lambda: expiry)
            assert await store.resolve(key) is None
            assert store.num_lookups == 1  # both answers came from the cache
        finally:
            await database.close()


async def test_the_cache_is_bounded_least_recently_used_first(tmp_path: Path) -> None:
    database = await open_database(_settings(state_dir=str(tmp_path)))
    try:
        tenant = await accounts.create_tenant(database, TenantCreate(name="t"))
        keys = [
            (await accounts.create_key(database, SECRET, KeyCreate(tenant=tenant["id"], name=f"k{n}")))[1]
            for n in range(3)
        ]
        store = KeyStore(database, SECRET, max_entries=2)
        for key in keys:
            assert await store.resolve(key) is not None
        assert (store.num_lookups, repr(store)) == (3, "KeyStore(num_cached=2)")
        await store.resolve(keys[2])
        assert store.num_lookups == 3
        await store.resolve(keys[0])  # evicted first
        assert store.num_lookups == 4
    finally:
        await database.close()


async def test_a_revocation_reaches_every_gateway_replica_within_a_second(tmp_path: Path) -> None:
    """Two gateways on one NATS and one database: a key revoked through one stops working on the other."""
    with EmbeddedNats() as nats:
        common = dict(
            nats_url=nats.url,
            http_port=0,
            grpc_port=0,
            api_keys=("sk-env-key",),
            admin_key="sk-admin-test",
            state_dir=str(tmp_path),
            log_level="warning",
        )
        gateways = [GatewayServer(_settings(**common), catalog=ModelCatalog([])) for _ in range(2)]
        for gateway in gateways:
            await gateway.start()
        one, two = (f"http://127.0.0.1:{gateway.http_port}" for gateway in gateways)
        admin = {"Authorization": "Bearer sk-admin-test"}
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{one}/admin/v1/tenants", json={"name": "acme"}, headers=admin) as response:
                    tenant = await response.json()
                async with session.post(
                    f"{one}/admin/v1/keys", json={"tenant": tenant["id"], "name": "app"}, headers=admin
                ) as response:
                    created = await response.json()

                async def status(base: str) -> int:
                    headers = {"Authorization": f"Bearer {created['key']}"}
                    async with session.get(f"{base}/v1/models", headers=headers) as response:
                        return response.status

                assert (await status(one), await status(two)) == (200, 200)
                async with session.delete(f"{one}/admin/v1/keys/{created['id']}", headers=admin) as response:
                    assert response.status == 200
                    revoked_at = time.monotonic()
                while await status(two) != 401:
                    assert time.monotonic() - revoked_at < 1.0, "the revocation did not reach the other replica"
                    await asyncio.sleep(0.01)
                assert await status(one) == 401
                env = {"Authorization": "Bearer sk-env-key"}  # KVMESH_API_KEYS: the default tenant, no row
                async with session.get(f"{two}/v1/models", headers=env) as response:
                    assert response.status == 200
        finally:
            for gateway in gateways:
                await gateway.stop()


async def test_a_database_that_cannot_be_read_is_a_503_not_a_401(tmp_path: Path) -> None:
    unreachable = Database(create_async_engine("postgresql+asyncpg://kvmesh@127.0.0.1:1/none"), "unreachable")
    store = KeyStore(unreachable, SECRET)
    with pytest.raises(GatewayError) as caught:
        await store.resolve(new_key())
    assert (caught.value.http_status, caught.value.message) == (
        503,
        "API keys cannot be checked right now; retry shortly",
    )
    await unreachable.close()
