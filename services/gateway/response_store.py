"""Stored Responses (the Responses API's `store: true`), in a NATS JetStream key-value bucket: a follow-up with
`previous_response_id` finds the conversation on whichever gateway replica it reaches, and a restart loses
nothing. Without NATS (embedding, unit tests) a process-local dict stands in.

A record is the response object plus the conversation that led to it, as chat messages (instructions
excluded: they do not carry over to a follow-up), and the tenant it belongs to: another tenant's get or
delete finds nothing, exactly as for an id that was never stored.

On a NATS cluster a store or read that meets a leader election (the node leading the bucket lost) is retried until
a new leader answers (`mesh.bus.through_election`): the request waits seconds instead of failing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from mesh.bus import jetstream_replicas, through_election
from mesh.logging import get_logger
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.tenancy.principal import DEFAULT_TENANT

log = get_logger(__name__)

BUCKET = "kvmesh_responses"
TTL_S = 30 * 24 * 3600.0  # stored responses expire after 30 days, as OpenAI's do
MAX_RECORD_BYTES = 1024 * 1024 - 4096  # under NATS's default max payload (1 MiB), headers included


class ResponseStore:
    def __init__(self, client: Any | None, bucket: str = BUCKET, ttl_s: float = TTL_S) -> None:
        self._client = client  # a connected nats.aio.client.Client, or None for the local dict
        self._bucket = bucket
        self._ttl_s = ttl_s
        self._kv: Any = None  # the JetStream KV handle, opened on first use; only _open writes it
        self._local: dict[str, bytes] = {}  # used only without a client
        self._lock = asyncio.Lock()

    async def _open(self) -> Any:
        if self._kv is not None:
            return self._kv
        from nats.js.errors import BucketNotFoundError

        async with self._lock:
            if self._kv is None:
                assert self._client is not None
                js = self._client.jetstream()
                try:
                    self._kv = await js.key_value(self._bucket)
                except BucketNotFoundError:
                    from nats.js.api import KeyValueConfig

                    self._kv = await js.create_key_value(
                        KeyValueConfig(bucket=self._bucket, history=1, ttl=self._ttl_s, replicas=jetstream_replicas())
                    )
        return self._kv

    async def put(self, response_id: str, record: dict[str, Any], tenant_id: str = DEFAULT_TENANT) -> bool:
        """Store a record of `tenant_id`; False (logged) when it is too large or NATS fails: the response stands."""
        data = json.dumps({**record, "tenant_id": tenant_id}, ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) > MAX_RECORD_BYTES:
            log.warning("response too large to store", response_id=response_id, num_bytes=len(data))
            return False
        if self._client is None:
            self._local[response_id] = data
            return True
        try:
            await through_election(lambda: self._put(response_id, data))
        except Exception as exc:  # the bus failing must not fail a response already generated
            log.warning("storing the response failed", response_id=response_id, error=str(exc)[:200])
            return False
        return True

    async def _put(self, response_id: str, data: bytes) -> None:
        await (await self._open()).put(response_id, data)

    async def _entry(self, response_id: str) -> Any:
        return await (await self._open()).get(response_id)

    async def get(self, response_id: str, tenant_id: str = DEFAULT_TENANT) -> dict[str, Any] | None:
        """The record, if it exists and belongs to `tenant_id` (None otherwise: the same answer for both)."""
        record = await self._get(response_id)
        if record is None or record.get("tenant_id", DEFAULT_TENANT) != tenant_id:
            return None
        return record

    async def _get(self, response_id: str) -> dict[str, Any] | None:
        if self._client is None:
            data = self._local.get(response_id)
            return None if data is None else dict(json.loads(data))
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            entry = await through_election(lambda: self._entry(response_id))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        except Exception as exc:
            log.warning("reading a stored response failed", response_id=response_id, error=str(exc)[:200])
            raise GatewayError(
                ErrorKind.UNAVAILABLE, "stored responses are unavailable right now; retry shortly"
            ) from None
        return None if not entry.value else dict(json.loads(entry.value))

    async def delete(self, response_id: str, tenant_id: str = DEFAULT_TENANT) -> bool:
        if await self.get(response_id, tenant_id) is None:
            return False
        if self._client is None:
            self._local.pop(response_id, None)
        else:
            await through_election(lambda: self._delete(response_id))
        return True

    async def _delete(self, response_id: str) -> None:
        await (await self._open()).delete(response_id)
