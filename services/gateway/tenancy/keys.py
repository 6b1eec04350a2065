"""API keys of tenants: made here, shown once, stored only as a keyed hash.

A key is `sk-kvm-` + 192 random bits (base64url). The database keeps only its digest: the hex HMAC-SHA256 of
the key under the server secret (gateway setting server_secret; when unset, one generated once and kept in
<state_dir>/server_secret, mode 0600). Without the secret a stolen table reveals nothing; every replica must
share it. Neither the key nor its digest is ever logged, put in an error body, a metric or a NATS message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from mesh.logging import get_logger
from services.gateway.config import GatewaySettings
from services.gateway.tenancy.principal import Limits

log = get_logger(__name__)

KEY_PREFIX = "sk-kvm-"
KEY_RANDOM_BYTES = 24  # 192 bits
SECRET_FILE = "server_secret"
LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(Limits))


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def new_id(prefix: str) -> str:
    """A public id: `ten_` or `key_` + 16 hex digits."""
    return f"{prefix}_{secrets.token_hex(8)}"


def key_digest(secret: bytes, key: str) -> str:
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()


def is_tenant_key(key: str) -> bool:
    """Whether `key` has the shape of a key made here (others are never looked up in the database)."""
    return key.startswith(KEY_PREFIX) and len(key) <= 128


def server_secret(settings: GatewaySettings) -> bytes:
    """The HMAC secret: the setting, or the one kept in <state_dir>/server_secret (made on first use)."""
    if settings.server_secret:
        return settings.server_secret.encode()
    path = Path(settings.state_dir).expanduser() / SECRET_FILE
    if not path.exists():
        _write_secret_once(path)
        log.warning(
            "generated a server secret; gateway replicas must share it (set KVMESH_SERVER_SECRET)", path=str(path)
        )
    secret = path.read_bytes().strip()
    assert secret, f"{path} is empty"
    return secret


def _write_secret_once(path: Path) -> None:
    """Write a new secret to `path` unless another process got there first (link(2) is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    try:
        os.link(draft, path)
    except FileExistsError:
        pass  # another replica wrote it: use that one
    finally:
        draft.unlink()


def limits_from_json(raw: Any, field: str) -> Limits:
    """Limits from their JSON object (as stored, or as sent to the admin API). A ValueError names the field
    (`limits.requests_per_minute`) of the first bad value."""
    if raw is None:
        return Limits()
    if not isinstance(raw, dict):
        raise ValueError(f"{field}: must be an object with any of {', '.join(LIMIT_FIELDS)}")
    for name, value in raw.items():
        if name not in LIMIT_FIELDS:
            raise ValueError(f"{field}.{name}: unknown limit (known: {', '.join(LIMIT_FIELDS)})")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{field}.{name}: must be a non-negative integer or null, not {value!r}")
    return Limits(**raw)


def limits_to_json(limits: Limits) -> dict[str, int]:
    """The limits that are set (None ones are left out)."""
    return {name: value for name, value in dataclasses.asdict(limits).items() if value is not None}
