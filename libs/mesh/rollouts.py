"""Canary rollouts' state in JetStream KV: bucket KVMESH_ROLLOUTS, one entry per rollout (events.proto Rollout),
so any gateway or balancer replica reads and continues it. Every write is a compare-and-set on the entry's
revision (`update`); a writer that loses reads again and decides again.

Who writes: the gateway's admin API creates a rollout and aborts it; who reads: the balancers, which route each
model's conversations by its latest rollout's weight (`splits`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from nats.aio.client import Client

from mesh.bus import jetstream_replicas
from mesh.logging import get_logger
from mesh.pb import events_pb2
from mesh.routing.canary import Split

BUCKET = "KVMESH_ROLLOUTS"
RUNNING, PROMOTED, ROLLED_BACK, ABORTED = "running", "promoted", "rolled_back", "aborted"
STATES = (RUNNING, PROMOTED, ROLLED_BACK, ABORTED)
STORE_TIMEOUT_S = 5.0
log = get_logger(__name__)


class RolloutConflict(Exception):
    """Another writer changed the rollout first (compare-and-set lost), or created one under the same id."""


def splits(rollouts: Iterable[events_pb2.Rollout]) -> dict[str, Split]:
    """Each model's split by its latest rollout (a finished one keeps its last weight: 0 after a rollback or an
    abort, so the canary stays drained; 100 after a promotion)."""
    latest: dict[str, events_pb2.Rollout] = {}
    for rollout in rollouts:
        known = latest.get(rollout.model)
        if known is None or (rollout.created_ms, rollout.rollout_id) > (known.created_ms, known.rollout_id):
            latest[rollout.model] = rollout
    return {model: Split(model, r.canary_version, r.weight) for model, r in latest.items()}


class RolloutStore:
    def __init__(self, client: Client) -> None:
        self.client = client  # the process's NATS connection (Bus.client)
        self._kv: Any = None
        self._open_lock = asyncio.Lock()

    async def _bucket(self) -> Any:
        from nats.js.api import KeyValueConfig
        from nats.js.errors import BucketNotFoundError

        async with self._open_lock:
            if self._kv is None:
                js = self.client.jetstream(timeout=STORE_TIMEOUT_S)
                try:
                    self._kv = await js.key_value(BUCKET)
                except BucketNotFoundError:
                    try:
                        self._kv = await js.create_key_value(
                            KeyValueConfig(bucket=BUCKET, history=1, replicas=jetstream_replicas())
                        )
                    except Exception:  # another replica created it in between
                        self._kv = await js.key_value(BUCKET)
        return self._kv

    async def create(self, rollout: events_pb2.Rollout) -> int:
        from nats.js.errors import KeyWrongLastSequenceError

        kv = await self._bucket()
        try:
            return int(await kv.create(rollout.rollout_id, rollout.SerializeToString()))
        except KeyWrongLastSequenceError as exc:
            raise RolloutConflict(f"rollout {rollout.rollout_id!r} exists") from exc

    async def get(self, rollout_id: str) -> tuple[events_pb2.Rollout, int] | None:
        """The rollout and its revision (for `update`), or None."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        kv = await self._bucket()
        try:
            entry = await kv.get(rollout_id)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return events_pb2.Rollout.FromString(entry.value or b""), int(entry.revision)

    async def list(self) -> list[events_pb2.Rollout]:
        """Every rollout, oldest first."""
        from nats.js.errors import NoKeysError

        kv = await self._bucket()
        try:
            keys = await kv.keys()
        except NoKeysError:
            return []
        found = [await self.get(key) for key in keys]
        return sorted((f[0] for f in found if f is not None), key=lambda r: (r.created_ms, r.rollout_id))

    async def update(self, rollout: events_pb2.Rollout, revision: int) -> int:
        """Write `rollout` if its entry is still at `revision`; RolloutConflict otherwise."""
        from nats.js.errors import KeyWrongLastSequenceError

        kv = await self._bucket()
        try:
            return int(await kv.update(rollout.rollout_id, rollout.SerializeToString(), last=revision))
        except KeyWrongLastSequenceError as exc:
            raise RolloutConflict(f"rollout {rollout.rollout_id!r} changed meanwhile") from exc

    async def follow(self, on_change: Callable[[events_pb2.Rollout], None]) -> asyncio.Task[None]:
        """Call `on_change` with every rollout as it is now, then with each write; cancel the task to stop."""
        kv = await self._bucket()
        watcher = await kv.watchall()
        return asyncio.create_task(_follow(watcher, on_change))


async def _follow(watcher: Any, on_change: Callable[[events_pb2.Rollout], None]) -> None:
    from nats.errors import TimeoutError as NatsTimeout

    try:
        while True:
            try:
                update = await watcher.updates(timeout=3600)
            except NatsTimeout:
                continue
            if update is not None and update.value:
                on_change(events_pb2.Rollout.FromString(update.value))
    finally:
        await watcher.stop()
