"""The salt of a request's KV cache root: what keeps one tenant's prompts from hitting another's cached blocks.

Every block key descends from root_hash(model, salt) (engine_core/kv_cache/block_hash.py), in the gateway (the
balancer's and prefill's block hashes) and in the workers alike, so one salt, derived here once per request and
carried as the request's cache_salt, partitions the whole mesh's KV. A tenant's salt is the hex HMAC-SHA256,
under the server secret, of its cache identity (`group:<cache_group>` or `tenant:<tenant id>`) and the client's
own cache_salt: tenants of one cache_group share KV, others never do, and nobody without the secret can name
another tenant's root. The `default` tenant (KVMESH_API_KEYS, or no keys at all) keeps the client's salt as it
is, so its block keys are exactly those of a mesh without tenants.
"""

from __future__ import annotations

import hashlib
import hmac

from services.gateway.tenancy.principal import Principal

_PREFIX = "t1:"  # marks a derived salt; the version lets the derivation change without colliding with the old


def cache_identity(tenant_id: str, cache_group: str | None) -> str:
    """Whose KV a tenant's requests share: its group's when it has one, else its own."""
    return f"group:{cache_group}" if cache_group else f"tenant:{tenant_id}"


def request_cache_salt(secret: bytes, principal: Principal | None, client_salt: str) -> str:
    """The cache_salt a request carries into the mesh (the client's, keyed by its tenant's cache identity)."""
    if principal is None or principal.cache_identity is None:
        return client_salt
    message = b"kvmesh/cache\0" + principal.cache_identity.encode() + b"\0" + client_salt.encode()
    return _PREFIX + hmac.new(secret, message, hashlib.sha256).hexdigest()
