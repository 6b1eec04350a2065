"""Usage reports (tenancy/usage.py): a tenant's totals by day and model, exact to the picodollar, and its records,
from rows the ledger's own settlement wrote; on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import pytest
import pytest_asyncio

from mesh.config import load_settings
from mesh.pb import events_pb2
from services.gateway.config import GatewaySettings
from services.gateway.errors import GatewayError
from services.gateway.tenancy import schema
from services.gateway.tenancy.db import Database, open_database
from services.gateway.tenancy.ledger import settle
from services.gateway.tenancy.usage import UsageQuery, parse_query, usage_report

from .tenancy_databases import BACKENDS, empty_database_url

TENANT = "ten_00000000000000aa"
DAY_1 = dt.datetime(2026, 12, 1, 23, 59, 59, 999000, tzinfo=dt.UTC)  # the last millisecond of Dec 1
DAY_2 = dt.datetime(2026, 12, 2, 0, 0, 0, tzinfo=dt.UTC)


def _record(request_id: str, model: str, at: dt.datetime, tokens: tuple[int, int, int], tenant: str = TENANT):
    prompt, cached, completion = tokens
    ms = int(at.timestamp() * 1000)
    return events_pb2.UsageRecord(
        request_id=request_id,
        tenant_id=tenant,
        key_id="key_00000000000000bb",
        model=model,
        api="chat.completions",
        status="finished",
        http_status=200,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        ttft_ms=5.0,
        e2e_ms=20.0,
        prefill_worker="prefill-a",
        decode_worker="decode-a",
        started_at_ms=ms - 20,
        ended_at_ms=ms,
    )


@pytest_asyncio.fixture(params=BACKENDS)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    async with empty_database_url(request.param, tmp_path) as url:
        database = await open_database(load_settings(GatewaySettings, env={}, api_keys=("k",), database_url=url))
        at = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
        async with database.engine.begin() as connection:
            await connection.execute(
                schema.tenants.insert().values(
                    id=TENANT, name="acme", limits={}, price_plan="pro", created_at=at, updated_at=at
                )
            )
            await connection.execute(
                schema.prices.insert().values(
                    plan="pro",
                    model="m1",
                    input_per_mtok=Decimal("0.1"),
                    cached_input_per_mtok=Decimal("0.01"),
                    output_per_mtok=Decimal("0.3"),
                    updated_at=at,
                )
            )
        records = [
            _record("r1", "m1", DAY_1, (1000, 200, 100)),  # 800 x 0.1 + 200 x 0.01 + 100 x 0.3 = 112 µ$
            _record("r2", "m1", DAY_1, (3, 0, 7)),  # 0.3 + 2.1 = 2.4 micro-dollars
            _record("r3", "m2", DAY_1, (50, 0, 5)),  # no price for m2: 0
            _record("r4", "m1", DAY_2, (1, 1, 1)),  # 0.01 + 0.3
            _record("r5", "m1", DAY_2, (9, 0, 9), tenant="ten_00000000000000cc"),  # another tenant
        ]
        assert await database.transaction(lambda connection: settle(connection, records)) == 5
        try:
            yield database
        finally:
            await database.close()


async def test_totals_by_day_and_model_are_exact(database: Database) -> None:
    report = await usage_report(database, UsageQuery(TENANT, dt.date(2026, 12, 1), dt.date(2026, 12, 2)))
    assert report.totals == [
        {
            "day": "2026-12-01",
            "model": "m1",
            "num_requests": 2,
            "prompt_tokens": 1003,
            "cached_tokens": 200,
            "completion_tokens": 107,
            "cost": "0.000114400000",
        },
        {
            "day": "2026-12-01",
            "model": "m2",
            "num_requests": 1,
            "prompt_tokens": 50,
            "cached_tokens": 0,
            "completion_tokens": 5,
            "cost": "0.000000000000",
        },
        {
            "day": "2026-12-02",
            "model": "m1",
            "num_requests": 1,
            "prompt_tokens": 1,
            "cached_tokens": 1,
            "completion_tokens": 1,
            "cost": "0.000000310000",
        },
    ]
    body = report.as_json()
    assert (body["num_requests"], body["cost"]) == (4, "0.000114710000")
    assert [r["request_id"] for r in body["records"]] == ["r1", "r2", "r3", "r4"]
    first = body["records"][0]
    assert first["ended_at"] == "2026-12-01T23:59:59.999000Z" and first["cost"] == "0.000112000000"
    assert (first["price_plan"], first["prompt_tokens"], first["decode_worker"]) == ("pro", 1000, "decode-a")


async def test_one_day_and_csv(database: Database) -> None:
    report = await usage_report(database, UsageQuery(TENANT, dt.date(2026, 12, 2), dt.date(2026, 12, 2), "csv"))
    assert report.as_csv() == (
        "day,model,num_requests,prompt_tokens,cached_tokens,completion_tokens,cost\n"
        "2026-12-02,m1,1,1,1,1,0.000000310000\n"
    )
    assert report.records == []  # CSV: the totals only


async def test_an_unknown_tenant_is_a_404_naming_it(database: Database) -> None:
    with pytest.raises(GatewayError) as caught:
        await usage_report(database, UsageQuery("ten_nope", dt.date(2026, 12, 1), dt.date(2026, 12, 2)))
    assert (caught.value.http_status, caught.value.param) == (404, "tenant")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"since": "2026-12-01"}, "tenant"),
        ({"tenant": TENANT}, "since"),
        ({"tenant": TENANT, "since": "2026-13-01"}, "since"),
        ({"tenant": TENANT, "since": "2026-12-02", "until": "2026-12-01"}, "until"),
        ({"tenant": TENANT, "since": "2026-12-01", "format": "xml"}, "format"),
        ({"tenant": TENANT, "since": "2026-12-01", "limit": "-1"}, "limit"),
    ],
)
def test_a_bad_query_is_a_400_naming_the_field(params: dict[str, str], field: str) -> None:
    with pytest.raises(GatewayError) as caught:
        parse_query(params)
    assert (caught.value.http_status, caught.value.param) == (400, field)


def test_until_defaults_to_today() -> None:
    query = parse_query({"tenant": TENANT, "since": "2026-12-01", "format": "csv"}, today=dt.date(2026, 12, 9))
    assert query == UsageQuery(TENANT, dt.date(2026, 12, 1), dt.date(2026, 12, 9), "csv", 1000)
