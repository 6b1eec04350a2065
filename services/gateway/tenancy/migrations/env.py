"""Alembic's entry point: db.py hands over an open connection (config.attributes["connection"])."""

from __future__ import annotations

from alembic import context

from services.gateway.tenancy.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata)
with context.begin_transaction():
    context.run_migrations()
