"""Alembic migrations of the tenancy database (tenancy/db.py applies them at open; env.py runs them on its
connection). A new migration: copy versions/0001_*.py, set down_revision to the newest one's revision."""
