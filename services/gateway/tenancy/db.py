"""The tenancy database: one async SQLAlchemy engine over SQLite (the default: `kvmesh.db` under state_dir, so
`make up` needs nothing) or PostgreSQL (`database_url=postgresql://...`, through asyncpg), with the Alembic
migrations in migrations/versions/ applied at open. Every gateway replica opens it; the migration is
serialized (a PostgreSQL advisory lock), so replicas may start together.

    database = await open_database(settings)
    async with database.engine.begin() as connection:
        await connection.execute(schema.tenants.insert().values(...))
    num_new = await database.transaction(lambda connection: settle(connection, records))   # sync work, one hop

`transaction` is for the writer on the request path (the ledger): through aiosqlite every DBAPI call (cursor,
execute, fetch, close, commit) is a trip to aiosqlite's thread and back through the event loop, about 25 a
request's two ledger transactions, each waking the loop; a sync function run on a thread over a second, sync engine
on the same file is one trip (PostgreSQL runs it through `AsyncConnection.run_sync`, asyncpg being async only).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, event, make_url
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from services.gateway.config import GatewaySettings

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
_MIGRATION_LOCK = 0x6B766D65  # "kvme": the advisory lock that serializes replicas migrating one PostgreSQL
T = TypeVar("T")
_DRIVERS = {"postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite"}


class DatabaseError(ValueError):
    """A database_url that cannot be used; the message names the setting, never a password."""


@dataclass(frozen=True)
class Database:
    engine: AsyncEngine
    url: str  # for logs: the password hidden
    sync_engine: Engine | None = None  # SQLite on a file: the same file through pysqlite, for `transaction`

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    async def transaction(self, work: Callable[[Connection], T]) -> T:
        """Run `work` in one transaction, committed when it returns (rolled back if it raises), off the event loop
        in one trip where the driver allows it (module docstring)."""
        if self.sync_engine is None:
            async with self.engine.begin() as connection:
                return await connection.run_sync(work)
        return await asyncio.to_thread(self._transaction, self.sync_engine, work)

    @staticmethod
    def _transaction(engine: Engine, work: Callable[[Connection], T]) -> T:
        with engine.begin() as connection:
            return work(connection)

    async def close(self) -> None:
        await self.engine.dispose()
        if self.sync_engine is not None:
            self.sync_engine.dispose()


def database_url(settings: GatewaySettings) -> URL:
    """The async URL the settings name: database_url with its driver made async, or the SQLite default."""
    if not settings.database_url:
        state_dir = Path(settings.state_dir).expanduser()
        state_dir.mkdir(parents=True, exist_ok=True)
        return make_url(f"sqlite+aiosqlite:///{state_dir / 'kvmesh.db'}")
    try:
        url = make_url(settings.database_url)
    except Exception:
        raise DatabaseError("KVMESH_DATABASE_URL: not a database URL (postgresql://... or sqlite:///...)") from None
    backend = url.drivername.split("+")[0]
    if backend not in _DRIVERS:
        raise DatabaseError(f"KVMESH_DATABASE_URL: unsupported database {backend!r} (postgresql or sqlite)")
    return url.set(drivername=_DRIVERS[backend])


async def open_database(settings: GatewaySettings) -> Database:
    """Connect and bring the schema to the newest migration."""
    url = database_url(settings)
    engine = create_async_engine(url, pool_pre_ping=url.get_backend_name() != "sqlite")
    if url.get_backend_name() == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    with _file_lock(url):
        async with engine.begin() as connection:
            await connection.run_sync(_migrate)
    return Database(engine, url.render_as_string(hide_password=True), _sync_sqlite_engine(url))


def _sync_sqlite_engine(url: URL) -> Engine | None:
    """A sync engine on the same SQLite file, with the same pragmas; none for PostgreSQL or an in-memory database
    (a second engine would open a second, empty one)."""
    if not _is_sqlite_file(url):
        return None
    engine = create_engine(url.set(drivername="sqlite+pysqlite"))
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _is_sqlite_file(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and bool(url.database) and url.database != ":memory:"


@contextlib.contextmanager
def _file_lock(url: URL) -> Iterator[None]:
    """SQLite: replicas (or test processes) sharing one file migrate one at a time (PostgreSQL: an advisory
    lock in _migrate). Held for the milliseconds of a migration, so blocking the loop is fine."""
    if not _is_sqlite_file(url):
        yield
        return
    with open(f"{url.database}.migrate-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL: readers (key lookups) never wait for the ledger's writer; busy_timeout: writers queue, not fail.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _migrate(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
