"""The admin API's request bodies (/admin/v1/, tenancy/admin_api.py, rollout_api.py): tenants, keys, prices and
canary rollouts. Unknown fields are refused by name (a misspelt limit must not silently mean "no limit")."""

from __future__ import annotations

import itertools
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

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


Ratio = Annotated[float, Field(ge=0, le=1000)]
# short, everyday, with one natural answer each: a canary with other weights soon answers one of them differently
DEFAULT_QUALITY_PROMPTS = (
    "What is the capital of France?",
    "Count from one to ten.",
    "Name the three primary colors.",
    "Write one sentence about the sea.",
)
Weight = Annotated[int, Field(strict=True, ge=1, le=100)]


class RolloutGatesBody(AdminBody):
    """What the canary must not exceed against the stable version (docs/operations.md, Canary rollouts); 0: off."""

    max_ttft_p95_ratio: Ratio = Field(default=1.5, description="canary p95 time to first token / stable's")
    max_itl_p95_ratio: Ratio = Field(default=1.5, description="canary p95 inter-token latency / stable's")
    max_error_rate_increase: float = Field(default=0.01, ge=0, le=1, description="canary error rate - stable's")
    max_cost_per_token_ratio: Ratio = Field(
        default=1.2, description="canary tokens computed per output token / stable's"
    )
    min_samples: int = Field(
        default=50, strict=True, ge=0, le=1_000_000, description="requests each version serves first"
    )
    quality_prompts: list[Annotated[str, Field(strict=True, min_length=1, max_length=2000)]] = Field(
        default_factory=lambda: list(DEFAULT_QUALITY_PROMPTS),
        max_length=20,
        description="golden prompts both versions answer greedily, compared token for token; [] : no quality probe",
    )
    quality_max_tokens: int = Field(
        default=16, strict=True, ge=1, le=256, description="tokens each golden answer runs to"
    )


class RolloutCreate(AdminBody):
    """POST /admin/v1/rollouts: move `model`'s conversations from one worker version to another, step by step."""

    model: Name
    stable_version: Name = Field(description="the version serving now (workers' KVMESH_VERSION)")
    canary_version: Name = Field(description="the version to roll out")
    steps: list[Weight] = Field(
        [5, 25, 50, 100], min_length=1, max_length=20, description="canary weights (percent), ascending, ending at 100"
    )
    check_interval_s: float = Field(
        default=60.0, gt=0, le=86_400, description="seconds between two judgements of a step"
    )
    gates: RolloutGatesBody = Field(default_factory=RolloutGatesBody)

    @field_validator("steps")
    @classmethod
    def _ascending_to_100(cls, steps: list[int]) -> list[int]:
        if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100:
            raise ValueError("steps must ascend and end at 100")
        return steps

    @field_validator("canary_version")
    @classmethod
    def _not_stable(cls, canary: str, info: Any) -> str:
        if canary == info.data.get("stable_version"):
            raise ValueError("canary_version must differ from stable_version")
        return canary


ADMIN_MODELS = (LimitsBody, TenantCreate, TenantUpdate, KeyCreate, Price, PricesUpdate, RolloutGatesBody, RolloutCreate)
