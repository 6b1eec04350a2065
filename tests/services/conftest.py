"""Fixtures shared by the service tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from .api_harness import ApiMesh, api_mesh


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def api_mesh_session() -> AsyncIterator[ApiMesh]:
    """One real mesh (SmolLM2, deepseek-tiny, deepseek-v4-tiny) for every API test module: its start costs a minute."""
    async with api_mesh() as mesh:
        yield mesh
