"""Which JSON Schemas the grammar enforces, checked before a request is routed.

xgrammar silently ignores some JSON Schema keywords (`not`, `if`/`then`, `dependentRequired`, ...) and
approximates others; a request relying on one would get output the grammar never checked. So every keyword
is looked up here: annotations pass, keywords the grammar enforces pass (within size limits that keep
compilation bounded), and anything else is refused with a 400 that names the keyword and where it is.
Unknown keywords (`x-...`, vendor extensions) constrain nothing under JSON Schema and pass.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from engine_core.structured_output import GrammarError, StructuredOutput, build_grammar
from services.gateway.errors import invalid

MAX_SCHEMA_CHARS = 32 * 1024
MAX_DEPTH = 24
MAX_COUNT = 4096  # minLength/maxLength/minItems/maxItems/...: grammars unroll repetition bounds
MAX_MULTIPLE_OF = 1000  # an integer multipleOf compiles to one state per residue
MAX_ENUM = 1024
MAX_PATTERN_CHARS = 1024
MAX_GRAMMAR_CHARS = 256 * 1024  # the built grammar's text: the compiled size follows it

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "nullable",
        "$defs",
        "definitions",  # the two last hold schemas: checked where referenced
    }
)
ENFORCED = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "uniqueItems",
        "properties",
        "required",
        "additionalProperties",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
    }
)
# JSON Schema keywords that constrain a value but that the grammar does not enforce.
UNSUPPORTED = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "contains",
        "minContains",
        "maxContains",
        "unevaluatedItems",
        "additionalItems",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
        "$dynamicRef",
        "$recursiveRef",
        "$anchor",
        "$dynamicAnchor",
        "$recursiveAnchor",
    }
)
FORMATS = frozenset(
    {
        "email",
        "date-time",
        "date",
        "time",
        "duration",
        "uri",
        "uri-reference",
        "uuid",
        "ipv4",
        "ipv6",
        "hostname",
    }
)
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})


class Unsupported(Exception):
    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{message} (at {where or '/'})")


def check_schema(schema: Any) -> None:
    """Raises Unsupported naming the first keyword the grammar cannot enforce."""
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise Unsupported("", f"the schema is over {MAX_SCHEMA_CHARS} characters")
    for where, node, depth in _walk(schema, "", 0, root=schema):
        if depth > MAX_DEPTH:
            raise Unsupported(where, f"schemas nest at most {MAX_DEPTH} levels")
        _check_node(where, node)


def _walk(node: Any, where: str, depth: int, root: Any) -> Iterator[tuple[str, dict[str, Any], int]]:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise Unsupported(where, "a schema must be an object or a boolean")
    yield where, node, depth
    for key in ("items", "additionalProperties", "propertyNames", "unevaluatedProperties"):
        if isinstance(node.get(key), (dict, bool)):
            yield from _walk(node[key], f"{where}/{key}", depth + 1, root)
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        children = node.get(key)
        if children is not None and not isinstance(children, dict):
            raise Unsupported(f"{where}/{key}", f"'{key}' must be an object")
        for name, child in (children or {}).items():
            yield from _walk(child, f"{where}/{key}/{name}", depth + 1, root)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        children = node.get(key)
        if children is not None and not (isinstance(children, list) and children):
            raise Unsupported(f"{where}/{key}", f"'{key}' must be a non-empty array")
        for index, child in enumerate(children or []):
            yield from _walk(child, f"{where}/{key}/{index}", depth + 1, root)


def _check_node(where: str, node: dict[str, Any]) -> None:
    for key, value in node.items():
        if key in UNSUPPORTED:
            raise Unsupported(where, f"the JSON Schema keyword '{key}' is not supported by structured output")
        if key in COUNTS and not (isinstance(value, int) and 0 <= value <= MAX_COUNT):
            raise Unsupported(where, f"'{key}' must be an integer in [0, {MAX_COUNT}]")
    kinds = node.get("type")
    for kind in kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []:
        if kind not in TYPES:
            raise Unsupported(where, f"unknown type {json.dumps(kind)[:40]}")
    if node.get("uniqueItems") is True:
        raise Unsupported(where, "the JSON Schema keyword 'uniqueItems' is not supported by structured output")
    if "format" in node and node["format"] not in FORMATS:
        raise Unsupported(
            where,
            f"the string format {json.dumps(node['format'])[:40]} is not supported "
            f"(supported: {', '.join(sorted(FORMATS))})",
        )
    if "pattern" in node:
        _check_pattern(where, node["pattern"])
    for key in ("patternProperties",):
        for pattern in node.get(key) or {}:
            _check_pattern(f"{where}/{key}", pattern)
    _check_numbers(where, node)
    if "enum" in node and not (isinstance(node["enum"], list) and 0 < len(node["enum"]) <= MAX_ENUM):
        raise Unsupported(where, f"'enum' must be an array of 1 to {MAX_ENUM} values")
    combinators = [key for key in ("anyOf", "oneOf", "allOf") if key in node]
    beside = sorted(key for key in node if key in ENFORCED and key not in ("anyOf", "oneOf", "allOf"))
    if combinators and beside:  # the grammar would enforce one side and silently drop the other
        raise Unsupported(
            where,
            f"'{combinators[0]}' beside other keywords of the same schema "
            f"({', '.join(repr(k) for k in beside)}) is not supported by structured output; "
            f"move them into each of its schemas",
        )
    if "allOf" in node and len(node["allOf"]) > 1:
        raise Unsupported(where, "'allOf' with more than one schema is not supported by structured output")
    if "oneOf" in node and not _are_disjoint(node["oneOf"]):
        raise Unsupported(
            where,
            "'oneOf' is supported only when its schemas have different types "
            "(an output matching two of them would be invalid); use 'anyOf'",
        )
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise Unsupported(where, f"only local '$ref's ('#/...') are supported, not {json.dumps(ref)[:60]}")
    if isinstance(node.get("items"), list):
        raise Unsupported(where, "'items' as an array (draft 4 tuples) is not supported; use 'prefixItems'")


def _check_pattern(where: str, pattern: Any) -> None:
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
        raise Unsupported(where, f"a pattern must be a string of at most {MAX_PATTERN_CHARS} characters")
    if _LOOKAROUND.search(pattern):
        raise Unsupported(where, "lookaround in a pattern is not supported by structured output")


def _check_numbers(where: str, node: dict[str, Any]) -> None:
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        value = node.get(key)
        if key in node and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise Unsupported(where, f"'{key}' must be a number")
    if "multipleOf" in node:
        value = node["multipleOf"]
        if node.get("type") != "integer" or not isinstance(value, int) or not 0 < value <= MAX_MULTIPLE_OF:
            raise Unsupported(where, f"'multipleOf' is supported for integers, as an integer in [1, {MAX_MULTIPLE_OF}]")


def _type_set(schema: Any) -> set[str] | None:
    if not isinstance(schema, dict) or "type" not in schema:
        return None
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    found = set(kinds)
    if "number" in found:
        found.add("integer")  # every integer is a number: the two overlap
    return found


def _are_disjoint(schemas: list[Any]) -> bool:
    seen: set[str] = set()
    for schema in schemas:
        kinds = _type_set(schema)
        if kinds is None or kinds & seen:
            return False
        seen |= kinds
    return True


def checked_grammar(kind: str, spec: str, param: str) -> StructuredOutput:
    """Build the grammar once here (no tokenizer: cheap) so a bad or oversized one is a 400 before routing."""
    try:
        structured = StructuredOutput(kind, spec)
        grammar = build_grammar(structured)
    except GrammarError as exc:
        raise invalid(param, str(exc)) from None
    if len(str(grammar)) > MAX_GRAMMAR_CHARS:
        raise invalid(param, f"the grammar is too large (over {MAX_GRAMMAR_CHARS} characters once built)")
    return structured


def json_schema_output(schema: Any, param: str) -> StructuredOutput:
    """A JSON Schema as a checked grammar; a 400 naming `param` and the feature otherwise."""
    if not isinstance(schema, (dict, bool)):
        raise invalid(param, f"'{param}' must be a JSON Schema object")
    try:
        check_schema(schema)
    except Unsupported as exc:
        raise invalid(param, str(exc)) from None
    return checked_grammar("json_schema", json.dumps(schema), param)
