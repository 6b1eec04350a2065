"""API keys. Only their SHA-256 digests are kept; a presented key is hashed and compared with every digest
in constant time, so neither timing nor any log line or error body reveals a key or its hash."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(key) for key in keys)  # the only state; written once
        assert self._digests, "a key ring needs at least one key"

    def __repr__(self) -> str:
        return f"KeyRing(num_keys={len(self._digests)})"

    def is_valid(self, key: str | None) -> bool:
        if not key:
            return False
        presented = _digest(key)
        matched = False
        for digest in self._digests:  # no early exit: the time taken does not depend on which key matched
            matched |= hmac.compare_digest(presented, digest)
        return matched


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value, or None when the header is absent or malformed."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None
