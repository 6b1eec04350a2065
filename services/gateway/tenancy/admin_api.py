"""The admin API, /admin/v1/: tenants, their keys and the price table (accounts.py does the work).

Guarded by the admin key (gateway setting admin_key): a request without a key gets 401; without an admin key
configured every other answer is 403 "the admin API is off"; a tenant's key gets 403, any other key 401.
/v1/mesh/workers is guarded the same way. Every change to a tenant or key is announced on TENANCY_CHANGED
(ids only), so each replica's KeyStore forgets what it cached; a revoked key stops working on every replica
within the NATS round trip.

    POST   /admin/v1/tenants              TenantCreate -> 201 the tenant
    GET    /admin/v1/tenants              every tenant
    GET    /admin/v1/tenants/{tenant_id}  one tenant
    PATCH  /admin/v1/tenants/{tenant_id}  TenantUpdate -> the tenant
    POST   /admin/v1/keys                 KeyCreate -> 201 the key's row with "key": the only time it is shown
    GET    /admin/v1/keys?tenant=ID       the keys (of one tenant), never their digests
    DELETE /admin/v1/keys/{key_id}        revoke -> the key's row with revoked_at
    GET    /admin/v1/prices               the price table
    GET    /admin/v1/usage?tenant=ID&since=YYYY-MM-DD[&until=...][&format=json|csv]   the ledger (tenancy/usage.py)
    PUT    /admin/v1/prices               PricesUpdate -> the price table
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from nats.aio.client import Client

from mesh.logging import get_logger
from services.gateway.api_models.admin import KeyCreate, PricesUpdate, TenantCreate, TenantUpdate
from services.gateway.api_models.base import validated
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.rest import PRINCIPAL, dumps, json_body, presented_key
from services.gateway.tenancy import accounts, usage
from services.gateway.tenancy.db import Database
from services.gateway.tenancy.store import KeyStore, publish_change

log = get_logger(__name__)

ADMIN_PREFIX = "/admin/v1"


@dataclass(frozen=True)
class Admin:
    """What the admin routes need; built once by server.py."""

    admin_key: str = ""  # empty: the admin API is off
    database: Database | None = None
    secret: bytes = b""
    store: KeyStore | None = None  # this replica's: forgets at once, before the NATS echo
    bus: Client | None = None

    def __repr__(self) -> str:
        return f"Admin(is_on={bool(self.admin_key)})"


ADMIN_KEY = web.AppKey("admin", Admin)


def require_admin(request: web.Request) -> Admin:
    """The admin state, if the request presents the admin key; otherwise the GatewayError to answer."""
    admin = request.app.get(ADMIN_KEY) or Admin()
    key = presented_key(request) or ""
    if admin.admin_key and hmac.compare_digest(key.encode(), admin.admin_key.encode()):
        return admin
    if not key:
        raise GatewayError(
            ErrorKind.INVALID_API_KEY, "this route needs the admin key: send 'Authorization: Bearer <key>'"
        )
    if not admin.admin_key:
        raise GatewayError(ErrorKind.PERMISSION_DENIED, "the admin API is off: set KVMESH_ADMIN_KEY on the gateway")
    if PRINCIPAL in request:
        raise GatewayError(ErrorKind.PERMISSION_DENIED, "this route needs the admin key; a tenant's key may not use it")
    raise GatewayError(ErrorKind.INVALID_API_KEY, "this route needs the admin key: send 'Authorization: Bearer <key>'")


def _database(request: web.Request) -> tuple[Admin, Database]:
    admin = require_admin(request)
    if admin.database is None:
        raise GatewayError(ErrorKind.UNAVAILABLE, "the tenancy database is not open on this gateway")
    return admin, admin.database


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=dumps)


def _list(data: list[dict[str, Any]]) -> web.Response:
    return _json({"object": "list", "data": data})


async def _announce(admin: Admin, tenant_ids: tuple[str, ...] = (), key_ids: tuple[str, ...] = ()) -> None:
    if admin.store is not None:
        admin.store.forget(tenant_ids, key_ids)
    await publish_change(admin.bus, tenant_ids, key_ids)


async def create_tenant(request: web.Request) -> web.Response:
    _, database = _database(request)
    tenant = await accounts.create_tenant(database, validated(TenantCreate, await json_body(request)))
    log.info("tenant created", tenant_id=tenant["id"])
    return _json(tenant, 201)


async def list_tenants(request: web.Request) -> web.Response:
    _, database = _database(request)
    return _list(await accounts.list_tenants(database))


async def get_tenant(request: web.Request) -> web.Response:
    _, database = _database(request)
    return _json(await accounts.get_tenant(database, request.match_info["tenant_id"]))


async def update_tenant(request: web.Request) -> web.Response:
    admin, database = _database(request)
    tenant_id = request.match_info["tenant_id"]
    tenant = await accounts.update_tenant(database, tenant_id, validated(TenantUpdate, await json_body(request)))
    await _announce(admin, tenant_ids=(tenant_id,))
    log.info("tenant updated", tenant_id=tenant_id)
    return _json(tenant)


async def create_key(request: web.Request) -> web.Response:
    admin, database = _database(request)
    row, key = await accounts.create_key(database, admin.secret, validated(KeyCreate, await json_body(request)))
    await _announce(admin, key_ids=(row["id"],))  # replicas drop cached unknowns: the new key may be one
    log.info("key created", tenant_id=row["tenant_id"], key_id=row["id"])
    return _json({**row, "key": key}, 201)


async def list_keys(request: web.Request) -> web.Response:
    _, database = _database(request)
    return _list(await accounts.list_keys(database, request.query.get("tenant")))


async def revoke_key(request: web.Request) -> web.Response:
    admin, database = _database(request)
    row = await accounts.revoke_key(database, request.match_info["key_id"])
    await _announce(admin, key_ids=(row["id"],))
    log.info("key revoked", tenant_id=row["tenant_id"], key_id=row["id"])
    return _json(row)


async def list_prices(request: web.Request) -> web.Response:
    _, database = _database(request)
    return _list(await accounts.list_prices(database))


async def put_prices(request: web.Request) -> web.Response:
    _, database = _database(request)
    return _list(await accounts.put_prices(database, validated(PricesUpdate, await json_body(request))))


async def get_usage(request: web.Request) -> web.Response:
    _, database = _database(request)
    query = usage.parse_query(request.query)
    report = await usage.usage_report(database, query)
    if query.format == "csv":
        return web.Response(text=report.as_csv(), content_type="text/csv")
    return _json(report.as_json())


def add_routes(app: web.Application) -> None:
    router = app.router
    router.add_post(f"{ADMIN_PREFIX}/tenants", create_tenant)
    router.add_get(f"{ADMIN_PREFIX}/tenants", list_tenants)
    router.add_get(f"{ADMIN_PREFIX}/tenants/{{tenant_id}}", get_tenant)
    router.add_patch(f"{ADMIN_PREFIX}/tenants/{{tenant_id}}", update_tenant)
    router.add_post(f"{ADMIN_PREFIX}/keys", create_key)
    router.add_get(f"{ADMIN_PREFIX}/keys", list_keys)
    router.add_delete(f"{ADMIN_PREFIX}/keys/{{key_id}}", revoke_key)
    router.add_get(f"{ADMIN_PREFIX}/prices", list_prices)
    router.add_put(f"{ADMIN_PREFIX}/prices", put_prices)
    router.add_get(f"{ADMIN_PREFIX}/usage", get_usage)
