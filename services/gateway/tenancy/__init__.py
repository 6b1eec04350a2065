"""Tenants: who is calling (principal.py), their keys and the admin API over them, what they may use (limits),
and what they used and owe (the usage ledger). Issue 14 builds it here, over the gateway's REST seam (rest.py)."""
