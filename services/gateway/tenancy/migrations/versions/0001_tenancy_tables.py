"""The four tenancy tables: tenants, api_keys, prices, usage_records (as in tenancy/schema.py).

Revision ID: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False, unique=True),
        sa.Column("limits", sa.JSON(), nullable=False),
        sa.Column("price_plan", sa.Text(), nullable=False, server_default="default"),
        sa.Column("cache_group", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("tenant_id", sa.String(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("digest", sa.String(), nullable=False, unique=True),
        sa.Column("models", sa.JSON(), nullable=True),
        sa.Column("apis", sa.JSON(), nullable=True),
        sa.Column("limits", sa.JSON(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "prices",
        sa.Column("plan", sa.Text(), primary_key=True),
        sa.Column("model", sa.Text(), primary_key=True),
        sa.Column("input_per_mtok", sa.Numeric(18, 9), nullable=False),
        sa.Column("cached_input_per_mtok", sa.Numeric(18, 9), nullable=False),
        sa.Column("output_per_mtok", sa.Numeric(18, 9), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "usage_records",
        sa.Column("request_id", sa.Text(), primary_key=True),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("api", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("e2e_ms", sa.Float(), nullable=False),
        sa.Column("prefill_worker", sa.Text(), nullable=True),
        sa.Column("decode_worker", sa.Text(), nullable=True),
        sa.Column("cost", sa.Numeric(24, 12), nullable=False),
        sa.Column("price_plan", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_usage_records_tenant_ended", "usage_records", ["tenant_id", "ended_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_records_tenant_ended", table_name="usage_records")
    for table in ("usage_records", "prices", "api_keys", "tenants"):
        op.drop_table(table)
