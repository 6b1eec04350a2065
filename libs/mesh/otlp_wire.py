"""Finished spans in OTLP's protobuf wire format, written directly.

The OTLP exporter's encoder (opentelemetry-exporter-otlp-proto-common) builds a protobuf message per span, per
attribute and per value before serializing them: about 35 us of CPU a span, in every process's export thread, on
the cores the mesh serves from. This writes the same bytes (tests/mesh/test_otlp_wire.py compares them with the
exporter's, field for field and byte for byte) in a fraction of that. Spans with links (kvmesh makes none) are left to
the exporter's encoder. Only the encoding is kvmesh's: the SDK makes the spans, the exporter sends them.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags: the parent's is_remote is known; the parent is remote
_FLAGS = {False: b"\x85\x01" + (_HAS_IS_REMOTE).to_bytes(4, "little"),  # field 16, fixed32
          True: b"\x85\x01" + (_HAS_IS_REMOTE | _IS_REMOTE).to_bytes(4, "little")}  # fmt: skip
MAX_CACHED = 4096
_SCALARS = frozenset((str, bool, int))
_ENCODED: dict[tuple[int, str, type, Any], bytes] = {}  # (tag, key, type, value) -> the field; the export thread's
_KINDS = tuple(b"\x30" + bytes((value + 1,)) for value in range(5))  # SpanKind.value -> OTLP's SPAN_KIND_* (+1)


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # an int64 below zero: ten bytes, as protobuf writes it
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field; `tag` is (field number << 3) | 2, under 128."""
    return bytes((tag,)) + _varint(len(payload)) + payload


def _string(tag: int, value: str | None) -> bytes:
    """A string field, left out when empty (proto3)."""
    return _field(tag, value.encode()) if value else b""


def _value(value: Any) -> bytes:
    """An AnyValue's fields (the exporter's _encode_value: the same order of checks)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"{value} is out of an int64's range")  # as protobuf: the exporter drops it
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        return _field(0x2A, b"".join([_field(0x0A, _value(v)) for v in value]))
    if isinstance(value, Mapping):
        return _field(0x32, b"".join([_field(0x0A, _key_value(str(k), v)) for k, v in value.items()]))
    raise TypeError(f"an attribute value of type {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    return _field(0x0A, key.encode()) + _field(0x12, _value(value))


def _attributes(tag: int, attributes: Mapping[str, Any] | None) -> bytes:
    """Each attribute as a field `tag`; a scalar one from the cache (most repeat: worker ids, rpc and model names)."""
    if not attributes:
        return b""
    parts = []
    for key, value in attributes.items():
        kind = type(value)
        cache_key = (tag, key, kind, value) if kind in _SCALARS else None  # the type: True == 1, yet encoded apart
        encoded = _ENCODED.get(cache_key) if cache_key is not None else None
        if encoded is None:
            encoded = _field(tag, _key_value(key, value))
            if cache_key is not None:
                if len(_ENCODED) >= MAX_CACHED:  # values that do not repeat (request ids, counts) pass through
                    _ENCODED.clear()
                _ENCODED[cache_key] = encoded
        parts.append(encoded)
    return b"".join(parts)


def _dropped(tag: int, count: int) -> bytes:
    return bytes((tag,)) + _varint(count) if count else b""


def _event(event: Any) -> bytes:
    return (
        b"\x09"
        + _FIXED64(event.timestamp)
        + _string(0x12, event.name)
        + _attributes(0x1A, event.attributes)
        + _dropped(0x20, event.dropped_attributes)
    )


def _status(status: Any) -> bytes:
    message = _string(0x12, status.description)
    code = b"\x18" + _varint(status.status_code.value) if status.status_code.value else b""
    return _field(0x7A, message + code)


def encode_span(span: Any) -> bytes:
    """One span's fields (a ReadableSpan without links), in field-number order as protobuf writes them."""
    context = span.context
    parent = span.parent
    parts = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08", context.span_id.to_bytes(8, "big")]
    if context.trace_state:
        parts.append(_field(0x1A, ",".join(f"{k}={v}" for k, v in context.trace_state.items()).encode()))
    if parent is not None:
        parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    parts += (_string(0x2A, span.name), _KINDS[span.kind.value], b"\x39", _FIXED64(span.start_time))
    parts += (b"\x41", _FIXED64(span.end_time), _attributes(0x4A, span.attributes))
    parts.append(_dropped(0x50, span.dropped_attributes))
    parts += [_field(0x5A, _event(event)) for event in span.events]
    parts.append(_dropped(0x60, span.dropped_events))
    parts.append(_dropped(0x70, span.dropped_links))
    if span.status is not None:
        parts.append(_status(span.status))
    parts.append(_FLAGS[parent is not None and parent.is_remote])
    return b"".join(parts)


def _scope(scope: Any) -> bytes:
    if scope is None:
        return b""
    return _string(0x0A, scope.name) + _string(0x12, scope.version) + _attributes(0x1A, scope.attributes)


def encode_request(spans: Sequence[Any]) -> bytes | None:
    """An ExportTraceServiceRequest's bytes: the spans grouped by resource, then by instrumentation scope, in the
    order first seen (as the exporter groups them). None when a span has links: the exporter's encoder does it.
    ValueError or TypeError for an attribute protobuf cannot hold (the exporter's encoder logs and drops it)."""
    grouped: dict[Any, dict[Any, list[bytes]]] = {}
    for span in spans:
        if span.links:
            return None
        by_scope = grouped.setdefault(span.resource, {})
        by_scope.setdefault(span.instrumentation_scope or None, []).append(_field(0x12, encode_span(span)))
    out = []
    for resource, by_scope in grouped.items():
        resource_part = _field(0x0A, _attributes(0x0A, resource.attributes))
        scope_parts = []
        for scope, encoded in by_scope.items():
            scope_url = _string(0x1A, scope.schema_url if scope is not None else None)
            scope_parts.append(_field(0x12, _field(0x0A, _scope(scope)) + b"".join(encoded) + scope_url))
        resource_url = _string(0x1A, resource.schema_url)
        out.append(_field(0x0A, resource_part + b"".join(scope_parts) + resource_url))
    return b"".join(out)
