"""schemathesis hooks for tests/services/test_gateway_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

One rule of the server's is a relation between two fields, which JSON Schema cannot state: min_tokens is at
most max_tokens (the field's description says so). Bodies that break it are not generated; every other rule is
in the document."""

from __future__ import annotations

from typing import Any

import schemathesis

UNSET_MAX_TOKENS = {"/v1/completions": 16}  # Completions' default; elsewhere unset means no limit


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _keeps_the_rule(path: str, body: Any) -> bool:
    if not isinstance(body, dict) or not _is_int(body.get("min_tokens")):
        return True
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens", UNSET_MAX_TOKENS.get(path))
    return not (_is_int(max_tokens) and body["min_tokens"] > max_tokens)


@schemathesis.hook
def filter_case(context: schemathesis.HookContext, case: schemathesis.Case) -> bool:
    """Every phase's cases (the coverage phase builds bodies without the body hooks)."""
    return _keeps_the_rule(case.operation.path, case.body)
