"""Prices at admission, for spend budgets (Limits.spend_per_day_micros, spend_per_month_micros): what a token costs
a tenant on a model, from the tenancy database's `prices` table under the tenant's `price_plan`, read into memory
every refresh_s (the admin API's price changes reach admission within that time).

Dollars per million tokens are micro-dollars per token, so a price here is the table's number as it stands."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import select

from mesh.logging import get_logger
from mesh.tasks import cancel_until_done
from services.gateway.tenancy import schema
from services.gateway.tenancy.pricing import TokenPrice

log = get_logger(__name__)
DEFAULT_PLAN = "default"  # the plan of a tenant without a row (the `default` tenant of KVMESH_API_KEYS)


class PriceBook:
    """The tenants' plans and the prices, refreshed in the background; `price` answers from memory."""

    def __init__(self, database: Any, refresh_s: float = 5.0) -> None:
        self._database = database  # a tenancy.db.Database
        self._refresh_s = refresh_s
        self._plans: dict[str, str] = {}  # tenant id -> plan; written only by refresh
        self._prices: dict[tuple[str, str], TokenPrice] = {}  # (plan, model) -> price; written only by refresh
        self._task: asyncio.Task[None] | None = None

    def price(self, tenant_id: str, model: str) -> TokenPrice | None:
        return self._prices.get((self._plans.get(tenant_id, DEFAULT_PLAN), model))

    async def refresh(self) -> None:
        async with self._database.engine.connect() as connection:
            tenants = (await connection.execute(select(schema.tenants.c.id, schema.tenants.c.price_plan))).all()
            prices = (await connection.execute(select(schema.prices))).all()
        self._plans = {tenant_id: plan for tenant_id, plan in tenants}
        self._prices = {(row.plan, row.model): TokenPrice.of_row(row) for row in prices}

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.ensure_future(self._refresh_forever())

    async def stop(self) -> None:
        await cancel_until_done(self._task)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # the last prices stand until the database answers again
                log.warning("reading prices failed", error=str(exc)[:200])
