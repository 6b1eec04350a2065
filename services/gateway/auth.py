"""API keys. Only their SHA-256 digests are kept; a presented key is hashed and compared with every digest
in constant time, so neither timing nor any log line or error body reveals a key or its hash."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from services.gateway.tenancy.principal import DEFAULT_TENANT, Principal


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(key) for key in keys)  # the only state; written once
        assert self._digests, "a key ring needs at least one key"

    def __repr__(self) -> str:
        return f"KeyRing(num_keys={len(self._digests)})"

    def is_valid(self, key: str | None) -> bool:
        return self.resolve(key) is not None

    def resolve(self, key: str | None) -> Principal | None:
        """The principal of a KVMESH_API_KEYS key: the default tenant, the key named by its position in the
        list (never by the key). None for a missing or unknown key."""
        if not key:
            return None
        presented = _digest(key)
        matched = -1
        for index, digest in enumerate(self._digests):  # no early exit: the time taken does not depend on the key
            if hmac.compare_digest(presented, digest):
                matched = index
        if matched < 0:
            return None
        return Principal(DEFAULT_TENANT, DEFAULT_TENANT, f"key_env_{matched}", f"KVMESH_API_KEYS[{matched}]")


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value, or None when the header is absent or malformed."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None
