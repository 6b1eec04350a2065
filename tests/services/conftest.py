"""Fixtures shared by the service tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from .api_harness import ApiMesh, api_mesh


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def api_mesh_session() -> AsyncIterator[ApiMesh]:
    """One real mesh (SmolLM2, deepseek-tiny, deepseek-v4-tiny) for every API test module: its start costs a minute.
    Stopped when the last of them ends (tests/scheduling.py): in this process, it holds 3-4 GiB."""
    async with api_mesh() as mesh:
        yield mesh
