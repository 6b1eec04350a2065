"""The admin API's request bodies (/admin/v1/, tenancy/admin_api.py): tenants, keys and prices. Unknown fields
are refused by name (a misspelt limit must not silently mean "no limit")."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from services.gateway.api_models.base import INT64_MAX, NonEmptyStr, RequestModel

Count = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
Name = Annotated[str, Field(strict=True, min_length=1, max_length=200)]
ApiName = Literal["chat.completions", "completions", "responses", "messages", "grpc"]
Money = Annotated[Decimal, Field(ge=0, le=Decimal("1e9"), max_digits=18, decimal_places=9)]


class AdminBody(RequestModel):
    """An admin request body: an unknown field is refused by name (a misspelt field must not be ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LimitsBody(AdminBody):
    """What a tenant or a key may use; an absent or null field: no limit of that kind. Tokens are prompt +
    completion; spend is in micro-dollars."""

    requests_per_minute: Count | None = None
    tokens_per_minute: Count | None = None
    max_concurrent: Count | None = None
    tokens_per_day: Count | None = None
    tokens_per_month: Count | None = None
    spend_per_day_micros: Count | None = None
    spend_per_month_micros: Count | None = None


class TenantCreate(AdminBody):
    name: Name
    limits: LimitsBody = LimitsBody()
    price_plan: Name = "default"
    cache_group: Name | None = Field(None, description="tenants of one group may share KV; absent: own cache only")


class TenantUpdate(AdminBody):
    """Only the fields sent change; `cache_group: ""` clears the group."""

    name: Name | None = None
    limits: LimitsBody | None = None
    price_plan: Name | None = None
    cache_group: Annotated[str, Field(strict=True, max_length=200)] | None = None


class KeyCreate(AdminBody):
    tenant: NonEmptyStr = Field(description="the tenant's id (ten_...)")
    name: Name
    models: list[NonEmptyStr] | None = Field(None, description="the models the key may use; absent: every model")
    apis: list[ApiName] | None = Field(None, description="the APIs the key may call; absent: every API")
    expires_at: datetime | None = Field(None, description="RFC 3339 with a time zone; absent: never")
    limits: LimitsBody = LimitsBody()


class Price(AdminBody):
    plan: Name = "default"
    model: Name
    input_per_mtok: Money = Field(description="US dollars per million prompt tokens")
    cached_input_per_mtok: Money = Field(description="US dollars per million prompt tokens served from cache")
    output_per_mtok: Money = Field(description="US dollars per million completion tokens")


class PricesUpdate(AdminBody):
    """PUT /admin/v1/prices: these rows are set (inserted or replaced); others stay."""

    prices: list[Price] = Field(min_length=1)


ADMIN_MODELS = (LimitsBody, TenantCreate, TenantUpdate, KeyCreate, Price, PricesUpdate)
