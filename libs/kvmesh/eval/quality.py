"""Quality of one answer: the golden exact match and each check of its workload line.

tool_call    a call (of the named tool, if the check names one) whose arguments are JSON valid against
             that tool's parameters schema in the request
json_schema  the text is JSON valid against the request's response_format schema (json_object: any object)
contains     the text contains the value
regex        the pattern matches somewhere in the text (re.search)
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from kvmesh.eval.client import RequestOutcome
from kvmesh.eval.workloads import Check, Turn


def judge(record: RequestOutcome, turn: Turn) -> None:
    """Fill record.quality: {"golden": bool | None, "checks": [{"kind", "passed", "why"}]}."""
    golden = None if turn.expected_text is None else record.is_ok and record.text == turn.expected_text
    checks = []
    for check in turn.checks:
        why = _failure(check, record, turn.body) if record.is_ok else f"the request failed ({record.error})"
        checks.append({"kind": check.kind, "passed": why is None, "why": why or ""})
    record.quality = {"golden": golden, "checks": checks}


def _failure(check: Check, record: RequestOutcome, body: dict[str, Any]) -> str | None:
    """None when the check passes, else why not."""
    if check.kind == "contains":
        return None if check.value in record.text else f"the text does not contain {check.value!r}"
    if check.kind == "regex":
        return None if re.search(check.value, record.text) else f"the text does not match {check.value!r}"
    if check.kind == "tool_call":
        return _tool_call_failure(check.value, record, body)
    return _schema_failure(record.text, body)


def tool_schemas(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters schema by name, in the body's API shape (chat, responses or messages)."""
    schemas = {}
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        function: dict[str, Any] = tool["function"] if isinstance(tool.get("function"), dict) else tool
        name = function.get("name")
        schema = function.get("parameters", function.get("input_schema", {}))
        if isinstance(name, str):
            schemas[name] = schema if isinstance(schema, dict) else {}
    return schemas


def _tool_call_failure(name: str, record: RequestOutcome, body: dict[str, Any]) -> str | None:
    schemas = tool_schemas(body)
    calls = [c for c in record.tool_calls if not name or c["name"] == name]
    if not calls:
        return f"no call of {name!r}" if name else "no tool call"
    for call in calls:
        if call["name"] not in schemas:
            return f"a call of {call['name']!r}, which is not among the request's tools"
        problem = _validation_failure(call["arguments"] or "{}", schemas[call["name"]])
        if problem:
            return f"the arguments of {call['name']!r}: {problem}"
    return None


def _schema_failure(text: str, body: dict[str, Any]) -> str | None:
    fmt = body.get("response_format") or (body.get("text") or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema", fmt.get("schema", {}))  # chat, else responses
        return _validation_failure(text, schema)
    return _validation_failure(text, {"type": "object"})


def _validation_failure(text: str, schema: dict[str, Any]) -> str | None:
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at {exc.pos})"
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError as exc:
        return f"invalid for the schema: {exc.message}"
    except jsonschema.SchemaError as exc:
        return f"the request's schema is not a valid JSON Schema: {exc.message}"
    return None
