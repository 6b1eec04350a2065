"""Open requests and the sweeper that settles those whose gateway died (services/gateway/tenancy/abandoned.py),
against a real NATS JetStream and both databases. The whole story with a SIGKILLed gateway process is
tests/integration/test_gateway_killed.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from kvmesh.nats_server import EmbeddedNats
from mesh import subjects
from mesh.bus import Bus
from mesh.config import load_settings
from mesh.pb import events_pb2
from services.gateway.config import GatewaySettings
from services.gateway.tenancy import schema
from services.gateway.tenancy.abandoned import AbandonedRequests, aborted_record, ensure_finished_stream, match_emitted
from services.gateway.tenancy.db import Database, open_database
from services.gateway.tenancy.ledger import OPEN, remember_open, settle

from .tenancy_databases import BACKENDS, empty_database_url


def now_ms() -> int:
    """The clock at the call: a module-level constant would be minutes old when the suite reaches a test."""
    return int(time.time() * 1000)


DEAD = ("gateway-0", 111)  # a gateway process no heartbeat names any more
LIVE = ("gateway-1", 222)


def finished(request_id: str, tokens: int, worker: str = "decode-0", at_ms: int | None = None) -> Any:
    at_ms = now_ms() if at_ms is None else at_ms
    return events_pb2.RequestFinished(
        request_id=request_id, worker_id=worker, num_output_tokens=tokens, finish_reason="abort", timestamp_ms=at_ms
    )


def opened(request_id: str, gateway: tuple[str, int] = DEAD, settle_in_s: float = 600.0, now: int = 0) -> Any:
    now = now or now_ms()
    started = now - 30_000
    return events_pb2.UsageRecord(
        request_id=request_id,
        tenant_id="ten_0123456789abcdef",
        key_id="key_0123456789abcdef",
        model="smollm2-135m",
        api="chat.completions",
        status=OPEN,
        prompt_tokens=40,
        cached_tokens=16,
        prefill_worker="prefill-0",
        decode_worker="decode-0",
        started_at_ms=started,
        gateway_id=gateway[0],
        gateway_started_at_ms=gateway[1],
        settle_after_ms=now + int(settle_in_s * 1000),
    )


def test_attempts_choices_retries_and_migrations_count_for_their_request_only() -> None:
    events = [
        finished("r1-a1b2c3d4", 5, at_ms=1),
        finished("r1-a1b2c3d4.m1", 7, worker="decode-1", at_ms=3),  # migrated: the worker it ended on
        finished("r1-a1b2c3d4.1", 2, at_ms=2),
        finished("r2-0", 4),  # choice 0 of r2 (n=2)
        finished("r2-1.m2", 6),
        finished("r1-a1b2c3d4x", 100),  # another request that shares the prefix
        finished("r3", 9),  # not asked about
    ]
    found = match_emitted(["r1-a1b2c3d4", "r2", "r4"], events)
    assert sorted(found) == ["r1-a1b2c3d4", "r2"]
    first = found["r1-a1b2c3d4"]
    assert (first.num_tokens, first.decode_worker, first.ended_at_ms) == (14, "decode-1", 3)
    assert first.attempts == ["r1-a1b2c3d4", "r1-a1b2c3d4.m1", "r1-a1b2c3d4.1"]
    assert found["r2"].num_tokens == 10


def test_the_aborted_record_keeps_the_prompt_and_bills_what_decode_emitted() -> None:
    now = now_ms()
    (emitted,) = match_emitted(["r1"], [finished("r1", 12, worker="decode-3", at_ms=now - 1000)]).values()
    record = aborted_record(opened("r1", now=now), emitted, now)
    assert (record.status, record.http_status, record.completion_tokens) == ("aborted", 0, 12)
    assert (record.prompt_tokens, record.cached_tokens, record.decode_worker) == (40, 16, "decode-3")
    assert (record.ended_at_ms, record.e2e_ms) == (now - 1000, 29_000)
    assert (record.gateway_id, record.gateway_started_at_ms, record.settle_after_ms) == ("", 0, 0)
    unheard = aborted_record(opened("r2", now=now), None, now)
    assert (unheard.completion_tokens, unheard.ended_at_ms) == (0, now)


@pytest.fixture
async def nats_bus() -> AsyncIterator[Bus]:
    with EmbeddedNats() as server:
        bus = await Bus.connect(server.url, name="test-abandoned")
        try:
            yield bus
        finally:
            await bus.client.close()


@contextlib.asynccontextmanager
async def _database(backend: str, tmp_path: Path) -> AsyncIterator[Database]:
    async with empty_database_url(backend, tmp_path) as url:
        settings = load_settings(GatewaySettings, env={}, api_keys=("k",), database_url=url)
        database = await open_database(settings)
        try:
            yield database
        finally:
            await database.close()


async def _rows(database: Database, table: Any) -> dict[str, Any]:
    async with database.engine.connect() as connection:
        return {row.request_id: row for row in await connection.execute(select(table))}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_open_request_lasts_until_its_record_in_either_order(backend: str, tmp_path: Path) -> None:
    async with _database(backend, tmp_path) as database:
        final = events_pb2.UsageRecord()
        final.CopyFrom(opened("late-open"))
        final.status, final.http_status, final.completion_tokens = "finished", 200, 9
        first = [opened("a"), opened("a"), opened("late-open")]
        assert await database.transaction(lambda connection: remember_open(connection, first)) == 2
        assert await database.transaction(lambda connection: settle(connection, [final])) == 1  # its open row goes
        late = [opened("late-open")]
        assert await database.transaction(lambda connection: remember_open(connection, late)) == 0  # after its record
        assert list(await _rows(database, schema.open_requests)) == ["a"]
        assert list(await _rows(database, schema.usage_records)) == ["late-open"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_sweeper_settles_what_is_due_once_and_leaves_live_requests(
    backend: str, tmp_path: Path, nats_bus: Bus
) -> None:
    async with _database(backend, tmp_path) as database:
        await ensure_finished_stream(nats_bus.client.jetstream())
        for event in (finished("orphan", 11), finished("orphan.m1", 3, worker="decode-1"), finished("live", 5)):
            await nats_bus.client.publish(subjects.REQUESTS_FINISHED, event.SerializeToString())  # as decode does
        await nats_bus.client.flush()
        records = [
            opened("orphan"),  # its gateway is gone and decode reported it: settled, 14 tokens
            opened("still-decoding"),  # its gateway is gone, no report yet: decode may still run; left
            opened("live", gateway=LIVE),  # its gateway is alive: left, whatever decode said
            opened("overdue", gateway=LIVE, settle_in_s=-1),  # past settle_after: settled, 0 tokens
        ]
        await database.transaction(lambda connection: remember_open(connection, records))

        replicas = [AbandonedRequests(nats_bus, database, lambda: {LIVE}, warmup_s=0.0) for _ in range(2)]
        written = await asyncio.gather(*(replica.sweep() for replica in replicas))  # two at once
        assert sum(written) == 2
        usage = await _rows(database, schema.usage_records)
        assert sorted(usage) == ["orphan", "overdue"]
        assert (usage["orphan"].status, usage["orphan"].completion_tokens, usage["orphan"].decode_worker) == (
            "aborted",
            14,
            "decode-1",
        )
        assert (usage["overdue"].status, usage["overdue"].completion_tokens) == ("aborted", 0)
        assert sorted(await _rows(database, schema.open_requests)) == ["live", "still-decoding"]
        assert await replicas[0].sweep() == 0  # nothing more is due

        unsure = AbandonedRequests(nats_bus, database, lambda: set(), warmup_s=60.0)
        assert await unsure.sweep() == 0  # not listened long enough to call any gateway dead
