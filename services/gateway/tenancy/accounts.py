"""Tenants, their keys and the price table in the database: what the admin API does, as plain async functions
over a Database. Each returns JSON-ready rows (times as RFC 3339, money as decimal strings: exact) and raises
GatewayError naming the field for an unknown id (404) or a taken name (409), having changed nothing.
A change to a tenant or key is announced by the caller (admin_api) on TENANCY_CHANGED."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from services.gateway.api_models.admin import KeyCreate, PricesUpdate, TenantCreate, TenantUpdate
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.tenancy.db import Database
from services.gateway.tenancy.keys import key_digest, new_id, new_key
from services.gateway.tenancy.schema import api_keys, prices, tenants
from services.gateway.tenancy.store import now, utc

_KEY_COLUMNS = [c for c in api_keys.c if c.name != "digest"]  # the digest never leaves the database


def _json(row: Mapping[Any, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in row.items():
        if isinstance(value, datetime):
            value = utc(value).isoformat()  # type: ignore[union-attr]
        elif isinstance(value, Decimal):
            value = format(value.normalize(), "f")
        out[name] = value
    return out


def _not_found(what: str, param: str, value: str) -> GatewayError:
    return GatewayError(ErrorKind.NOT_FOUND, f"{param}: no {what} {value!r}", param)


async def _tenant_row(connection: AsyncConnection, tenant_id: str, param: str) -> dict[str, Any]:
    row = (await connection.execute(select(tenants).where(tenants.c.id == tenant_id))).mappings().first()
    if row is None:
        raise _not_found("tenant", param, tenant_id)
    return _json(row)


async def create_tenant(database: Database, body: TenantCreate) -> dict[str, Any]:
    moment = now()
    values = {
        "id": new_id("ten"),
        "name": body.name,
        "limits": body.limits.model_dump(exclude_none=True),
        "price_plan": body.price_plan,
        "cache_group": body.cache_group,
        "created_at": moment,
        "updated_at": moment,
    }
    try:
        async with database.engine.begin() as connection:
            await connection.execute(tenants.insert().values(values))
    except IntegrityError:
        raise GatewayError(ErrorKind.CONFLICT, f"name: a tenant named {body.name!r} exists", "name") from None
    return _json(values)


async def list_tenants(database: Database) -> list[dict[str, Any]]:
    async with database.engine.connect() as connection:
        rows = (await connection.execute(select(tenants).order_by(tenants.c.created_at, tenants.c.id))).mappings()
        return [_json(row) for row in rows]


async def get_tenant(database: Database, tenant_id: str) -> dict[str, Any]:
    async with database.engine.connect() as connection:
        return await _tenant_row(connection, tenant_id, "tenant_id")


async def update_tenant(database: Database, tenant_id: str, body: TenantUpdate) -> dict[str, Any]:
    changes: dict[str, Any] = {"updated_at": now()}
    if body.name is not None:
        changes["name"] = body.name
    if body.limits is not None:
        changes["limits"] = body.limits.model_dump(exclude_none=True)
    if body.price_plan is not None:
        changes["price_plan"] = body.price_plan
    if body.cache_group is not None:
        changes["cache_group"] = body.cache_group or None
    try:
        async with database.engine.begin() as connection:
            await _tenant_row(connection, tenant_id, "tenant_id")
            await connection.execute(tenants.update().where(tenants.c.id == tenant_id).values(changes))
            return await _tenant_row(connection, tenant_id, "tenant_id")
    except IntegrityError:
        raise GatewayError(ErrorKind.CONFLICT, f"name: a tenant named {body.name!r} exists", "name") from None


async def create_key(database: Database, secret: bytes, body: KeyCreate) -> tuple[dict[str, Any], str]:
    """The new key's row and the key itself: the only time it exists outside the client."""
    if body.expires_at is not None and body.expires_at.tzinfo is None:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "expires_at: must carry a time zone (e.g. Z)", "expires_at")
    if body.expires_at is not None and body.expires_at <= now():
        raise GatewayError(ErrorKind.INVALID_REQUEST, "expires_at: must be in the future", "expires_at")
    key = new_key()
    values = {
        "id": new_id("key"),
        "tenant_id": body.tenant,
        "name": body.name,
        "digest": key_digest(secret, key),
        "models": None if body.models is None else sorted(set(body.models)),
        "apis": None if body.apis is None else sorted(set(body.apis)),
        "limits": body.limits.model_dump(exclude_none=True),
        "expires_at": body.expires_at,
        "revoked_at": None,
        "created_at": now(),
    }
    async with database.engine.begin() as connection:
        await _tenant_row(connection, body.tenant, "tenant")
        await connection.execute(api_keys.insert().values(values))
    del values["digest"]
    return _json(values), key


async def list_keys(database: Database, tenant_id: str | None) -> list[dict[str, Any]]:
    query = select(*_KEY_COLUMNS).order_by(api_keys.c.created_at, api_keys.c.id)
    async with database.engine.connect() as connection:
        if tenant_id is not None:
            await _tenant_row(connection, tenant_id, "tenant")
            query = query.where(api_keys.c.tenant_id == tenant_id)
        return [_json(row) for row in (await connection.execute(query)).mappings()]


async def revoke_key(database: Database, key_id: str) -> dict[str, Any]:
    """Revoke (idempotent: a second revocation keeps the first time)."""
    async with database.engine.begin() as connection:
        where = api_keys.c.id == key_id
        if (await connection.execute(select(api_keys.c.id).where(where))).first() is None:
            raise _not_found("key", "key_id", key_id)
        await connection.execute(
            api_keys.update().where(where, api_keys.c.revoked_at.is_(None)).values(revoked_at=now())
        )
        row = (await connection.execute(select(*_KEY_COLUMNS).where(where))).mappings().one()
    return _json(row)


async def list_prices(database: Database) -> list[dict[str, Any]]:
    async with database.engine.connect() as connection:
        rows = (await connection.execute(select(prices).order_by(prices.c.plan, prices.c.model))).mappings()
        return [_json(row) for row in rows]


async def put_prices(database: Database, body: PricesUpdate) -> list[dict[str, Any]]:
    """Insert or replace each (plan, model) row, all in one transaction."""
    moment = now()
    async with database.engine.begin() as connection:
        for price in body.prices:
            key = (prices.c.plan == price.plan) & (prices.c.model == price.model)
            await connection.execute(prices.delete().where(key))
            await connection.execute(prices.insert().values(**price.model_dump(), updated_at=moment))
    return await list_prices(database)
