"""The tenancy databases the tests run against: a SQLite file under a temporary directory, and a fresh
PostgreSQL database on the machine's server (127.0.0.1:5432, trust auth), created for one test and dropped
after, so the server's `test` database is never touched. Where no PostgreSQL answers, that variant skips."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator

import pytest

POSTGRES_ADMIN_URL = os.environ.get("KVMESH_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
BACKENDS = ("sqlite", "postgresql")


async def _admin_connection():  # type: ignore[no-untyped-def]
    import asyncpg

    try:
        return await asyncpg.connect(POSTGRES_ADMIN_URL, timeout=3)
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.skip(f"no PostgreSQL at {POSTGRES_ADMIN_URL} ({type(exc).__name__}: {exc})")


@contextlib.asynccontextmanager
async def postgres_url() -> AsyncIterator[str]:
    """The URL of a new, empty PostgreSQL database, dropped on exit (its connections ended first)."""
    name = f"kvmesh_test_{secrets.token_hex(6)}"
    admin = await _admin_connection()
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
        yield f"{base}/{name}"
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@contextlib.asynccontextmanager
async def empty_database_url(backend: str, tmp_path: os.PathLike[str]) -> AsyncIterator[str]:
    """A database_url setting for `backend` ("sqlite" or "postgresql"), empty and private to the test."""
    if backend == "sqlite":
        yield f"sqlite:///{os.fspath(tmp_path)}/tenancy.db"
        return
    async with postgres_url() as url:
        yield url
