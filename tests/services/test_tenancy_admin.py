"""The admin API (/admin/v1/) on a real gateway over a real NATS and each database: the admin key guards it, a
tenant's key gets 403, bad input is a 4xx naming the field with nothing changed; and no key or digest ever
reaches a log line, an error body, a metric or a NATS message."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from kvmesh.nats_server import EmbeddedNats
from mesh.config import load_settings
from services.gateway.catalog import ModelCatalog
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer
from services.gateway.tenancy.keys import key_digest, server_secret

from .tenancy_databases import BACKENDS, empty_database_url

ADMIN = "sk-admin-tenancy-3d9f"
ENV_KEY = "sk-env-tenancy-77aa"
FRESH_PROCESS = "KVMESH_TEST_FRESH_PROCESS"


class Client:
    """The gateway's REST surface as a test speaks to it: (status, JSON body) per call; every body is kept."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session, self.base = session, base
        self.bodies: list[str] = []

    async def call(self, method: str, path: str, key: str | None = ADMIN, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.request(method, self.base + path, json=body, headers=headers) as response:
            text = await response.text()
            self.bodies.append(text)
            return response.status, json.loads(text) if text.startswith(("{", "[")) else text


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, database_url: str = "", **settings: Any
) -> AsyncIterator[tuple[Client, GatewayServer]]:
    with EmbeddedNats() as bus:
        values = dict(
            nats_url=bus.url,
            http_port=0,
            grpc_port=0,
            api_keys=(ENV_KEY,),
            admin_key=ADMIN,
            state_dir=str(tmp_path),
            database_url=database_url,
            log_level="warning",
        )
        server = GatewayServer(load_settings(GatewaySettings, env={}, **{**values, **settings}), ModelCatalog([]))
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                yield Client(session, f"http://127.0.0.1:{server.http_port}"), server
        finally:
            await server.stop()


def _error(body: Any) -> tuple[str, str | None]:
    return body["error"]["type"], body["error"]["param"]


async def test_no_key_or_digest_in_logs_error_bodies_metrics_or_nats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that creates, uses, misuses and revokes keys, with every log line (debug level), every response
    body, /metrics and every NATS message (`>`) kept: none holds a key or its digest."""
    if os.environ.get(FRESH_PROCESS) != "1":
        # structlog caches each logger at its first use, writing where logging pointed then: in a fresh
        # interpreter every logger of the gateway writes where this test reads
        test = f"{__file__}::test_no_key_or_digest_in_logs_error_bodies_metrics_or_nats"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
        done = subprocess.run(command, env={**os.environ, FRESH_PROCESS: "1"}, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-4000:]
        assert "1 passed" in done.stdout
        return
    messages: list[bytes] = []
    logs = io.StringIO()  # the gateway's log output: it configures logging onto sys.stderr as it starts
    monkeypatch.setattr(sys, "stderr", logs)
    async with gateway(tmp_path, log_level="debug") as (api, server):
        spy = await nats.connect(server.settings.nats_url)

        async def keep(msg: Any) -> None:
            messages.append(msg.subject.encode() + b" " + msg.data + json.dumps(msg.headers or {}).encode())

        await spy.subscribe(">", cb=keep)
        _, tenant = await api.call("POST", "/admin/v1/tenants", body={"name": "leak-check"})
        keys = []
        for name in ("a", "b"):
            status, created = await api.call("POST", "/admin/v1/keys", body={"tenant": tenant["id"], "name": name})
            assert status == 201
            keys.append(created)
        key = keys[0]["key"]
        assert (await api.call("GET", "/v1/models", key=key))[0] == 200
        assert (await api.call("GET", "/admin/v1/tenants", key=key))[0] == 403  # misuse: a tenant key on admin
        assert (await api.call("GET", "/v1/models", key=key + "x"))[0] == 401  # a near miss
        assert (await api.call("POST", "/v1/chat/completions", key=key, body={"model": "none"}))[0] in (400, 404)
        assert (await api.call("DELETE", f"/admin/v1/keys/{keys[0]['id']}"))[0] == 200
        assert (await api.call("GET", "/v1/models", key=key))[0] == 401  # revoked
        assert (await api.call("GET", "/v1/models", key=keys[1]["key"]))[0] == 200
        assert (await api.call("GET", "/metrics", key=None))[0] == 401  # the admin key's
        assert (await api.call("GET", "/metrics", key=keys[1]["key"]))[0] == 403  # a tenant key
        metrics = (await api.call("GET", "/metrics"))[1]
        await asyncio.sleep(0.2)
        await spy.drain()
        secret = server_secret(server.settings)
    log_text = logs.getvalue()
    assert "generated a server secret" in log_text and "key revoked" in log_text  # the log lines were captured
    assert any(b"kvmesh.tenancy.changed" in message for message in messages)  # and so was NATS
    shown = [api.bodies[i] for i, body in enumerate(api.bodies) if '"key": "sk-kvm-' in body]
    assert len(shown) == 2  # the two creations: the only bodies that may show a key
    others = "\n".join(body for body in api.bodies if body not in shown)
    nats_text = b"\n".join(messages).decode(errors="replace")
    for created in keys:
        for secret_text in (created["key"], key_digest(secret, created["key"])):
            for where, text in (("logs", log_text), ("bodies", others), ("metrics", metrics), ("nats", nats_text)):
                assert secret_text not in text, f"a key or digest leaked into {where}"
        assert created["key"][7:20] not in log_text + others + metrics + nats_text  # not even a fragment


@pytest.mark.parametrize("backend", BACKENDS)
async def test_tenants_keys_and_prices_through_the_admin_api(backend: str, tmp_path: Path) -> None:
    async with empty_database_url(backend, tmp_path) as url, gateway(tmp_path, url) as (api, _):
        status, acme = await api.call(
            "POST", "/admin/v1/tenants", body={"name": "acme", "limits": {"max_concurrent": 4}}
        )
        assert status == 201
        assert acme["id"].startswith("ten_") and len(acme["id"]) == 20
        assert (acme["name"], acme["limits"], acme["price_plan"], acme["cache_group"]) == (
            "acme",
            {"max_concurrent": 4},
            "default",
            None,
        )
        assert await api.call("GET", f"/admin/v1/tenants/{acme['id']}") == (200, acme)
        status, changed = await api.call(
            "PATCH", f"/admin/v1/tenants/{acme['id']}", body={"limits": {"tokens_per_day": 10}, "cache_group": "g1"}
        )
        assert status == 200
        assert (changed["limits"], changed["cache_group"], changed["name"]) == ({"tokens_per_day": 10}, "g1", "acme")
        status, created = await api.call(
            "POST", "/admin/v1/keys", body={"tenant": acme["id"], "name": "ci", "models": ["m"], "apis": ["responses"]}
        )
        assert status == 201
        assert created["key"].startswith("sk-kvm-") and created["id"].startswith("key_")
        assert (created["tenant_id"], created["models"], created["apis"], created["revoked_at"]) == (
            acme["id"],
            ["m"],
            ["responses"],
            None,
        )
        status, listing = await api.call("GET", f"/admin/v1/keys?tenant={acme['id']}")
        assert status == 200
        assert [row["id"] for row in listing["data"]] == [created["id"]]
        assert "key" not in listing["data"][0] and "digest" not in listing["data"][0]
        # a tenant's key may not administer, nor list the mesh's workers
        assert _error((await api.call("GET", "/admin/v1/tenants", key=created["key"]))[1]) == ("permission_error", None)
        assert (await api.call("GET", "/v1/mesh/workers", key=created["key"]))[0] == 403
        assert (await api.call("GET", "/admin/v1/tenants", key=ENV_KEY))[0] == 403
        assert (await api.call("GET", "/admin/v1/tenants", key="sk-wrong"))[0] == 401
        status, revoked = await api.call("DELETE", f"/admin/v1/keys/{created['id']}")
        assert status == 200 and revoked["revoked_at"] is not None
        assert (await api.call("GET", "/v1/models", key=created["key"]))[0] == 401
        prices = [{"model": "m", "input_per_mtok": 0.15, "cached_input_per_mtok": "0.075", "output_per_mtok": 0.6}]
        status, table = await api.call("PUT", "/admin/v1/prices", body={"prices": prices})
        assert status == 200
        assert [
            (row["plan"], row["model"], row["input_per_mtok"], row["cached_input_per_mtok"], row["output_per_mtok"])
            for row in table["data"]
        ] == [("default", "m", "0.15", "0.075", "0.6")]
        assert (await api.call("GET", "/admin/v1/prices"))[1]["data"] == table["data"]
        assert [t["name"] for t in (await api.call("GET", "/admin/v1/tenants"))[1]["data"]] == ["acme"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_bad_admin_input_is_a_4xx_naming_the_field_and_changes_nothing(backend: str, tmp_path: Path) -> None:
    async with empty_database_url(backend, tmp_path) as url, gateway(tmp_path, url) as (api, _):
        status, acme = await api.call("POST", "/admin/v1/tenants", body={"name": "acme"})
        assert status == 201
        cases: list[tuple[str, str, Any, int, str | None]] = [
            ("POST", "/admin/v1/tenants", {"name": "acme"}, 409, "name"),
            ("POST", "/admin/v1/tenants", {"name": "b", "limits": {"rpm": 1}}, 400, "limits.rpm"),
            (
                "POST",
                "/admin/v1/tenants",
                {"name": "b", "limits": {"max_concurrent": -1}},
                400,
                "limits.max_concurrent",
            ),
            (
                "POST",
                "/admin/v1/tenants",
                {"name": "b", "limits": {"tokens_per_day": 1.5}},
                400,
                "limits.tokens_per_day",
            ),
            ("POST", "/admin/v1/tenants", {"limits": {}}, 400, "name"),
            ("POST", "/admin/v1/tenants", {"name": "b", "limit": {"max_concurrent": 1}}, 400, "limit"),
            (
                "POST",
                "/admin/v1/keys",
                {"tenant": acme["id"], "name": "k", "expires_at": "2020-01-01T00:00:00Z"},
                400,
                "expires_at",
            ),
            ("GET", "/admin/v1/tenants/ten_0000000000000000", None, 404, "tenant_id"),
            ("PATCH", "/admin/v1/tenants/ten_0000000000000000", {"name": "x"}, 404, "tenant_id"),
            ("PATCH", f"/admin/v1/tenants/{acme['id']}", {"limits": "lots"}, 400, "limits"),
            ("POST", "/admin/v1/keys", {"tenant": "ten_0000000000000000", "name": "k"}, 404, "tenant"),
            ("POST", "/admin/v1/keys", {"tenant": acme["id"], "name": "k", "apis": ["ftp"]}, 400, "apis[0]"),
            ("POST", "/admin/v1/keys", {"tenant": acme["id"], "name": "k", "expires_at": "soon"}, 400, "expires_at"),
            (
                "POST",
                "/admin/v1/keys",
                {"tenant": acme["id"], "name": "k", "expires_at": "2030-01-01T00:00:00"},
                400,
                "expires_at",
            ),
            ("GET", "/admin/v1/keys?tenant=ten_0000000000000000", None, 404, "tenant"),
            ("DELETE", "/admin/v1/keys/key_0000000000000000", None, 404, "key_id"),
            (
                "PUT",
                "/admin/v1/prices",
                {"prices": [{"model": "m", "input_per_mtok": -1, "cached_input_per_mtok": 0, "output_per_mtok": 0}]},
                400,
                "prices[0].input_per_mtok",
            ),
            ("PUT", "/admin/v1/prices", {"prices": []}, 400, "prices"),
        ]
        for method, path, body, expected_status, param in cases:
            status, answer = await api.call(method, path, body=body)
            assert (status, answer["error"]["param"]) == (expected_status, param), (method, path, body, answer)
            assert (
                param is None
                or param in answer["error"]["message"]
                or param.split("[")[0] in answer["error"]["message"]
            )
        assert [t["id"] for t in (await api.call("GET", "/admin/v1/tenants"))[1]["data"]] == [acme["id"]]
        assert (await api.call("GET", "/admin/v1/tenants"))[1]["data"][0] == acme
        assert (await api.call("GET", "/admin/v1/keys"))[1]["data"] == []
        assert (await api.call("GET", "/admin/v1/prices"))[1]["data"] == []


async def test_without_an_admin_key_the_admin_api_is_off(tmp_path: Path) -> None:
    async with gateway(tmp_path, admin_key="") as (api, _):
        status, body = await api.call("GET", "/admin/v1/tenants", key=ENV_KEY)
        assert status == 403
        assert body["error"]["message"] == "the admin API is off: set KVMESH_ADMIN_KEY on the gateway"
        assert (await api.call("GET", "/v1/mesh/workers", key=ENV_KEY))[0] == 403
        assert (await api.call("GET", "/admin/v1/tenants", key=None))[0] == 401


async def test_the_admin_cli_speaks_to_the_admin_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmesh.cli import main

    async with gateway(tmp_path) as (api, _):

        async def admin(*argv: str) -> tuple[int, Any]:
            code = await asyncio.to_thread(main, ["admin", "--url", api.base, *argv])
            out, err = capsys.readouterr()
            return code, json.loads(out) if code == 0 else err

        monkeypatch.setenv("KVMESH_ADMIN_KEY", ADMIN)
        code, tenant = await admin("tenants", "create", "--name", "acme", "--limits", '{"requests_per_minute": 60}')
        assert (code, tenant["name"], tenant["limits"]) == (0, "acme", {"requests_per_minute": 60})
        code, changed = await admin("tenants", "update", tenant["id"], "--price-plan", "gold")
        assert (code, changed["price_plan"], changed["limits"]) == (0, "gold", {"requests_per_minute": 60})
        code, created = await admin("keys", "create", "--tenant", tenant["id"], "--name", "ci", "--models", "m1")
        assert code == 0 and created["key"].startswith("sk-kvm-") and created["models"] == ["m1"]
        code, listing = await admin("keys", "list", "--tenant", tenant["id"])
        assert (code, [row["id"] for row in listing["data"]]) == (0, [created["id"]])
        code, revoked = await admin("keys", "revoke", created["id"])
        assert code == 0 and revoked["revoked_at"] is not None
        args = ("--model", "m1", "--input", "0.15", "--cached-input", "0.075", "--output", "0.6")
        code, table = await admin("prices", "set", *args)
        assert (code, table["data"][0]["output_per_mtok"]) == (0, "0.6")
        code, error = await admin("tenants", "create", "--name", "acme")
        assert code == 1 and json.loads(error)["error"]["param"] == "name"  # the gateway's 409, on stderr
        code, error = await admin("tenants", "get", "ten_missing")
        assert code == 1 and json.loads(error)["error"]["param"] == "tenant_id"
        monkeypatch.delenv("KVMESH_ADMIN_KEY")
        code, error = await admin("tenants", "list")
        assert (code, error) == (2, "kvmesh admin: no admin key: pass --admin-key or set KVMESH_ADMIN_KEY\n")
        code, tenants = await admin("--admin-key", ADMIN, "tenants", "list")
        assert code == 0 and [t["name"] for t in tenants["data"]] == ["acme"]
