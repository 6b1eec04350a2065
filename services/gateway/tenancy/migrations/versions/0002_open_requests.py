"""open_requests: requests that started generating and have no usage record yet (as in tenancy/schema.py).

Revision ID: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "open_requests",
        sa.Column("request_id", sa.Text(), primary_key=True),
        sa.Column("gateway_id", sa.Text(), nullable=False),
        sa.Column("gateway_started_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("settle_after", sa.DateTime(timezone=True), nullable=False),
        sa.Column("record", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("open_requests")
