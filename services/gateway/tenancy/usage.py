"""Usage reports from the ledger (usage_records): one tenant's totals by day (UTC) and model, and its records,
for `GET /admin/v1/usage?tenant=ID&since=YYYY-MM-DD[&until=YYYY-MM-DD][&format=json|csv][&limit=N]` and
`kvmesh admin usage`. Read-only: the ledger consumer is the table's only writer.

Days run from `since` to `until`, both included (until: today when absent). Cost sums are exact: each record's
cost is summed as an integer number of picodollars (NUMERIC(24, 12)), on SQLite as on PostgreSQL.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, Date, cast, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.tenancy import schema
from services.gateway.tenancy.db import Database
from services.gateway.tenancy.principal import DEFAULT_TENANT

FORMATS = ("json", "csv")
DEFAULT_LIMIT = 1000  # records listed in a JSON report (the totals always cover every record)
MAX_LIMIT = 100_000
PICO = 10**12
TOTAL_FIELDS = (
    "day",
    "model",
    "num_requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost",
)


@dataclass(frozen=True)
class UsageQuery:
    tenant_id: str
    since: dt.date
    until: dt.date  # included
    format: str = "json"
    limit: int = DEFAULT_LIMIT

    @property
    def start(self) -> dt.datetime:
        return dt.datetime.combine(self.since, dt.time(), tzinfo=dt.UTC)

    @property
    def end(self) -> dt.datetime:
        """The first instant after `until`."""
        return dt.datetime.combine(self.until + dt.timedelta(days=1), dt.time(), tzinfo=dt.UTC)


@dataclass(frozen=True)
class UsageReport:
    query: UsageQuery
    totals: list[dict[str, Any]]  # TOTAL_FIELDS, by day then model; cost a decimal string
    records: list[dict[str, Any]] = field(default_factory=list)  # the first `limit`, by end time

    def as_json(self) -> dict[str, Any]:
        return {
            "object": "usage_report",
            "tenant": self.query.tenant_id,
            "since": self.query.since.isoformat(),
            "until": self.query.until.isoformat(),
            "totals": self.totals,
            "num_requests": sum(total["num_requests"] for total in self.totals),
            "cost": dollars(sum((Decimal(total["cost"]) for total in self.totals), Decimal(0))),
            "records": self.records,
        }

    def as_csv(self) -> str:
        """The totals, one row per day and model."""
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=TOTAL_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.totals)
        return out.getvalue()


def dollars(amount: Decimal) -> str:
    """Money as text: 12 decimal places, never an exponent."""
    return f"{amount:.12f}"


def _date(params: Mapping[str, str], name: str) -> dt.date | None:
    raw = params.get(name)
    if raw is None:
        return None
    try:
        return dt.date.fromisoformat(raw)
    except ValueError:
        raise invalid(name, f"'{name}' must be a date, YYYY-MM-DD; got {raw!r}") from None


def parse_query(params: Mapping[str, str], today: dt.date | None = None) -> UsageQuery:
    """The report's query string; a bad or missing field is a 400 naming it."""
    tenant_id = params.get("tenant", "")
    if not tenant_id:
        raise invalid("tenant", "'tenant' is required: the id of the tenant to report on")
    since = _date(params, "since")
    if since is None:
        raise invalid("since", "'since' is required: the first day to report, YYYY-MM-DD")
    until = _date(params, "until") or today or dt.datetime.now(dt.UTC).date()
    if until < since:
        raise invalid("until", f"'until' ({until}) is before 'since' ({since})")
    report_format = params.get("format", "json")
    if report_format not in FORMATS:
        raise invalid("format", f"'format' must be json or csv; got {report_format!r}")
    raw_limit = params.get("limit", str(DEFAULT_LIMIT))
    if not raw_limit.isdigit() or int(raw_limit) > MAX_LIMIT:
        raise invalid("limit", f"'limit' must be a whole number from 0 to {MAX_LIMIT}; got {raw_limit!r}")
    return UsageQuery(tenant_id, since, until, report_format, int(raw_limit))


def _day(connection: AsyncConnection) -> Any:
    ended_at = schema.usage_records.c.ended_at
    if connection.dialect.name == "postgresql":
        return cast(func.timezone("UTC", ended_at), Date)
    return func.date(ended_at)  # SQLite keeps the UTC time as text


async def _check_tenant(connection: AsyncConnection, tenant_id: str) -> None:
    if tenant_id == DEFAULT_TENANT:  # KVMESH_API_KEYS' tenant has no row
        return
    found = await connection.execute(select(schema.tenants.c.id).where(schema.tenants.c.id == tenant_id))
    if found.first() is None:
        raise GatewayError(ErrorKind.NOT_FOUND, f"tenant: no tenant {tenant_id!r}", "tenant")


async def _totals(connection: AsyncConnection, query: UsageQuery) -> list[dict[str, Any]]:
    records = schema.usage_records
    day = _day(connection).label("day")
    statement = (
        select(
            day,
            records.c.model,
            func.count().label("num_requests"),
            func.sum(records.c.prompt_tokens).label("prompt_tokens"),
            func.sum(records.c.cached_tokens).label("cached_tokens"),
            func.sum(records.c.completion_tokens).label("completion_tokens"),
            func.sum(cast(func.round(records.c.cost * PICO), BigInteger)).label("picodollars"),
        )
        .where(
            records.c.tenant_id == query.tenant_id, records.c.ended_at >= query.start, records.c.ended_at < query.end
        )
        .group_by(day, records.c.model)
        .order_by(day, records.c.model)
    )
    return [
        {
            "day": str(row.day),
            "model": row.model,
            "num_requests": int(row.num_requests),
            "prompt_tokens": int(row.prompt_tokens),
            "cached_tokens": int(row.cached_tokens),
            "completion_tokens": int(row.completion_tokens),
            "cost": dollars(Decimal(int(row.picodollars)).scaleb(-12)),
        }
        for row in await connection.execute(statement)
    ]


def _utc(value: dt.datetime) -> str:
    aware = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)  # SQLite gives naive UTC times
    return aware.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def _record(row: Any) -> dict[str, Any]:
    record = dict(row._mapping)
    record["cost"] = dollars(Decimal(record["cost"]))
    record["started_at"] = _utc(record["started_at"])
    record["ended_at"] = _utc(record["ended_at"])
    return record


async def usage_report(database: Database, query: UsageQuery) -> UsageReport:
    """The tenant's totals over every record of the query's days, and (JSON) its first `limit` records."""
    records = schema.usage_records
    async with database.engine.connect() as connection:
        await _check_tenant(connection, query.tenant_id)
        totals = await _totals(connection, query)
        listed: list[dict[str, Any]] = []
        if query.format == "json" and query.limit:
            statement = (
                select(records)
                .where(
                    records.c.tenant_id == query.tenant_id,
                    records.c.ended_at >= query.start,
                    records.c.ended_at < query.end,
                )
                .order_by(records.c.ended_at, records.c.request_id)
                .limit(query.limit)
            )
            listed = [_record(row) for row in await connection.execute(statement)]
    return UsageReport(query, totals, listed)
