"""The tenancy database's tables (SQLAlchemy Core): tenants, their API keys, the price table, and the usage
ledger with its open requests. One definition: the Alembic migrations (migrations/versions/) create exactly
these, and every module that reads or writes the database (keys, store, admin_api, ledger, usage) imports its
tables from here.

Ids are text: `ten_` or `key_` + 16 hex digits. Money is NUMERIC (exact); times are timezone-aware.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    String,
    Table,
    Text,
)

metadata = MetaData()

tenants = Table(
    "tenants",
    metadata,
    Column("id", String, primary_key=True),  # ten_ + 16 hex
    Column("name", Text, nullable=False, unique=True),
    Column("limits", JSON, nullable=False),  # the fields of principal.Limits that are set
    Column("price_plan", Text, nullable=False, server_default="default"),
    Column("cache_group", Text, nullable=True),  # tenants of one group may share KV; null: its own cache only
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String, primary_key=True),  # key_ + 16 hex: the key's public name, never the key
    Column("tenant_id", String, ForeignKey("tenants.id"), nullable=False),
    Column("name", Text, nullable=False),
    Column("digest", String, nullable=False, unique=True),  # hex HMAC-SHA256 of the key under the server secret
    Column("models", JSON, nullable=True),  # null: every model
    Column("apis", JSON, nullable=True),  # null: every API
    Column("limits", JSON, nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=True),
    Column("revoked_at", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

prices = Table(
    "prices",
    metadata,
    Column("plan", Text, primary_key=True),
    Column("model", Text, primary_key=True),
    Column("input_per_mtok", Numeric(18, 9), nullable=False),  # US dollars per million tokens
    Column("cached_input_per_mtok", Numeric(18, 9), nullable=False),
    Column("output_per_mtok", Numeric(18, 9), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

# Append-only: one row per request, written once by the ledger consumer (request_id is the idempotency key).
usage_records = Table(
    "usage_records",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    Column("key_id", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("api", Text, nullable=False),
    Column("status", Text, nullable=False),  # finished | client_gone | failed | timeout | aborted | refused
    Column("http_status", Integer, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("ttft_ms", Float, nullable=True),
    Column("e2e_ms", Float, nullable=False),
    Column("prefill_worker", Text, nullable=True),
    Column("decode_worker", Text, nullable=True),
    Column("cost", Numeric(24, 12), nullable=False),  # dollars
    Column("price_plan", Text, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("ended_at", DateTime(timezone=True), nullable=False),
    Index("ix_usage_records_tenant_ended", "tenant_id", "ended_at"),
)

# Requests that started generating and have no usage record yet (ledger.py): a row goes when the request's record
# is written, or when the abandoned-request sweeper (abandoned.py) settles it as aborted because its gateway died.
open_requests = Table(
    "open_requests",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("gateway_id", Text, nullable=False),
    Column("gateway_started_at_ms", BigInteger, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("settle_after", DateTime(timezone=True), nullable=False),  # settled then whatever the heartbeats say
    Column("record", LargeBinary, nullable=False),  # the open UsageRecord, serialized
)

TABLE_NAMES = ("tenants", "api_keys", "prices", "usage_records", "open_requests")
