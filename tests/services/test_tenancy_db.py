"""The tenancy database opens empty and migrates to the four tables, on SQLite and on PostgreSQL; its sync
transactions (the ledger's) commit or roll back as a whole."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import inspect, select
from sqlalchemy.engine import Connection

from mesh.config import SettingError, load_settings
from services.gateway.config import GatewaySettings
from services.gateway.tenancy.db import DatabaseError, database_url, open_database
from services.gateway.tenancy.schema import TABLE_NAMES, tenants

from .tenancy_databases import BACKENDS, empty_database_url


def _settings(**overrides: object) -> GatewaySettings:
    return load_settings(GatewaySettings, env={}, api_keys=("k",), **overrides)


def _columns(connection) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
    inspector = inspect(connection)
    return {name: [c["name"] for c in inspector.get_columns(name)] for name in inspector.get_table_names()}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_empty_database_migrates_to_the_five_tables(backend: str, tmp_path: Path) -> None:
    async with empty_database_url(backend, tmp_path) as url:
        database = await open_database(_settings(database_url=url))
        try:
            async with database.engine.connect() as connection:
                columns = await connection.run_sync(_columns)
                indexes = await connection.run_sync(lambda c: inspect(c).get_indexes("usage_records"))
        finally:
            await database.close()
        assert sorted(columns) == sorted((*TABLE_NAMES, "alembic_version"))
        assert columns["tenants"] == [
            "id", "name", "limits", "price_plan", "cache_group", "created_at", "updated_at"
        ]  # fmt: skip
        assert columns["api_keys"] == [
            "id", "tenant_id", "name", "digest", "models", "apis", "limits", "expires_at", "revoked_at", "created_at"
        ]  # fmt: skip
        assert columns["prices"] == [
            "plan", "model", "input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "updated_at"
        ]  # fmt: skip
        assert len(columns["usage_records"]) == 18
        assert columns["open_requests"] == [
            "request_id", "gateway_id", "gateway_started_at_ms", "started_at", "settle_after", "record"
        ]  # fmt: skip
        assert [(i["name"], i["column_names"]) for i in indexes] == [
            ("ix_usage_records_tenant_ended", ["tenant_id", "ended_at"])
        ]
        # opened again: the migration is already applied, nothing changes
        again = await open_database(_settings(database_url=url))
        async with again.engine.connect() as connection:
            assert sorted(await connection.run_sync(_columns)) == sorted(columns)
            version = (await connection.exec_driver_sql("SELECT version_num FROM alembic_version")).scalar_one()
        await again.close()
        assert version == "0002"


async def test_the_default_is_sqlite_under_the_state_dir(tmp_path: Path) -> None:
    settings = _settings(state_dir=str(tmp_path / "state"))
    assert str(database_url(settings)) == f"sqlite+aiosqlite:///{tmp_path}/state/kvmesh.db"
    database = await open_database(settings)
    await database.close()
    assert database.is_sqlite
    assert (tmp_path / "state" / "kvmesh.db").is_file()


def test_a_postgres_url_gets_the_async_driver_and_a_bad_one_names_the_setting() -> None:
    url = database_url(_settings(database_url="postgresql://u:pw@db:5432/x"))
    assert url.drivername == "postgresql+asyncpg"
    assert url.render_as_string(hide_password=True) == "postgresql+asyncpg://u:***@db:5432/x"
    with pytest.raises(DatabaseError, match="KVMESH_DATABASE_URL: unsupported database 'mysql'"):
        database_url(_settings(database_url="mysql://h/x"))
    with pytest.raises(DatabaseError, match="KVMESH_DATABASE_URL: not a database URL"):
        database_url(_settings(database_url="::nonsense"))
    assert issubclass(SettingError, ValueError)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_transaction_commits_what_returns_and_rolls_back_what_raises(backend: str, tmp_path: Path) -> None:
    at = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)

    def add(name: str, fail: bool) -> Callable[[Connection], int]:
        def work(connection: Connection) -> int:
            row = {"id": f"ten_{name}", "name": name, "limits": {}, "price_plan": "pro", "created_at": at}
            connection.execute(tenants.insert().values(**row, updated_at=at))
            if fail:
                raise RuntimeError("the work failed")
            return threading.get_ident()

        return work

    async with empty_database_url(backend, tmp_path) as url:
        database = await open_database(_settings(database_url=url))
        try:
            thread_id = await database.transaction(add("kept", fail=False))
            with pytest.raises(RuntimeError, match="the work failed"):
                await database.transaction(add("undone", fail=True))
            async with database.engine.connect() as connection:
                names = (await connection.execute(select(tenants.c.name).order_by(tenants.c.name))).scalars().all()
        finally:
            await database.close()
    assert names == ["kept"]
    # SQLite: the work ran on a thread, in one trip, not on the event loop (PostgreSQL: in run_sync, on the loop)
    assert (thread_id != threading.get_ident()) == (backend == "sqlite")
