"""Snapshots of the global KV index, which keep the KV event stream short (the compactor and the follower that
restores them are in `mesh.kv_stream`).

KVMESH_KV keeps every KV event batch, and a follower that starts replays them all. Caches churn: a week of
device events is far more than what the caches hold, replay would take minutes, and the stream's byte limit would
drop a store node's old `stored` events while it still holds those blocks. So a balancer (which follows every
tier) compacts the stream once it has applied `every` messages since the last snapshot
(`mesh.kv_stream.KVIndexCompactor`):

    1. it serializes its index as of its last applied message (`GlobalKVIndex.to_snapshot(seq)`),
    2. puts it in the JetStream object store KVMESH_KV_SNAPSHOTS as `index-<seq>-<its own id>`,
    3. moves the pointer `latest` in the KV bucket KVMESH_KV_SNAPSHOT from the previous snapshot to its own,
       compare-and-set on the pointer's revision (a replica that lost the race deletes its object and stops),
    4. deletes the previous snapshot's object and purges the stream below seq + 1.

A follower that starts restores the latest snapshot and replays from the message after it. One that falls
behind a purge sees a gap in the stream's sequence numbers and restores again. Like a missed batch, a snapshot a
little behind costs at most a miss: keys are content hashes and every fetched block is checked.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass

from nats.js.api import KeyValueConfig, ObjectStoreConfig
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, ObjectNotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from mesh.bus import Bus, jetstream_replicas
from mesh.logging import get_logger
from mesh.pb import events_pb2

OBJECTS = "KVMESH_KV_SNAPSHOTS"
POINTER_BUCKET = "KVMESH_KV_SNAPSHOT"
LATEST = "latest"
log = get_logger(__name__)


async def _pointer(js: JetStreamContext, create: bool) -> KeyValue | None:
    """The pointer's bucket; made if missing when `create` (the balancer, which writes snapshots), else None."""
    try:
        return await js.key_value(POINTER_BUCKET)
    except Exception:  # BucketNotFoundError, or a JetStream API error
        if not create:
            return None
        try:
            return await js.create_key_value(
                KeyValueConfig(bucket=POINTER_BUCKET, history=1, replicas=jetstream_replicas())
            )
        except Exception:  # another process created it in between
            return await js.key_value(POINTER_BUCKET)


async def _objects(js: JetStreamContext, create: bool) -> ObjectStore | None:
    try:
        return await js.object_store(OBJECTS)
    except Exception:
        if not create:
            return None
        try:
            return await js.create_object_store(
                OBJECTS, ObjectStoreConfig(bucket=OBJECTS, replicas=jetstream_replicas())
            )
        except Exception:
            return await js.object_store(OBJECTS)


@dataclass(frozen=True)
class Pointer:
    """The pointer `latest`: which object holds the latest snapshot, and of which stream seq."""

    stream_seq: int  # 0: no snapshot yet
    object_name: str = ""
    revision: int | None = None  # the pointer's revision, for a compare-and-set (None: no pointer yet)


async def latest(bus: Bus, create: bool = True) -> Pointer:
    """The pointer as it is now (Pointer(0): no snapshot yet, or, for a reader, no snapshot store yet)."""
    kv = await _pointer(bus.client.jetstream(), create)
    if kv is None:
        return Pointer(0)
    try:
        entry = await kv.get(LATEST)
    except KeyNotFoundError:
        return Pointer(0)
    seq, _, name = (entry.value or b"0").decode().partition(" ")
    return Pointer(int(seq), name, entry.revision)


async def latest_seq(bus: Bus) -> int:
    """The latest snapshot's stream seq (0 when there is none)."""
    return (await latest(bus)).stream_seq


async def load_latest(bus: Bus, attempts: int = 3, create: bool = True) -> events_pb2.KVIndexSnapshot | None:
    """The latest snapshot, or None when nothing was compacted yet. A newer snapshot can replace the one the
    pointer named while it is read (its object is deleted): then the pointer is read again. `create=False`: a
    reader, which never makes the snapshot stores (None while they do not exist)."""
    objects = await _objects(bus.client.jetstream(), create)
    if objects is None:
        return None
    for _ in range(attempts):
        pointer = await latest(bus, create)
        if not pointer.stream_seq:
            return None
        try:
            result = await objects.get(pointer.object_name)
        except ObjectNotFoundError:
            continue
        return events_pb2.KVIndexSnapshot.FromString(result.data or b"")
    raise RuntimeError(f"no readable KV index snapshot after {attempts} attempts (snapshots replaced too fast)")


async def publish(bus: Bus, snapshot: events_pb2.KVIndexSnapshot, previous: Pointer) -> int | None:
    """Store `snapshot` and move the pointer from `previous` (as last read) to it. Returns the seq of the snapshot
    it replaced (0 for none), or None when it was not newer than `previous` or another writer moved the pointer
    since (its object is deleted). Each writer's object has its own name, so a loser never deletes the winner's
    snapshot of the same seq."""
    js = bus.client.jetstream()
    seq = snapshot.stream_seq
    if previous.stream_seq >= seq:
        return None
    objects, kv = await _objects(js, True), await _pointer(js, True)
    assert objects is not None and kv is not None  # made when missing
    name = f"index-{seq}-{uuid.uuid4().hex[:12]}"
    await objects.put(name, snapshot.SerializeToString())
    value = f"{seq} {name}".encode()
    try:
        if previous.revision is None:
            await kv.create(LATEST, value)
        else:
            await kv.update(LATEST, value, last=previous.revision)
    except KeyWrongLastSequenceError:  # (any other error may have moved the pointer: the object stays)
        await _delete_quietly(objects, name)
        log.info("KV index snapshot dropped: another writer moved the pointer first", seq=seq)
        return None
    if previous.object_name:
        await _delete_quietly(objects, previous.object_name)
    return previous.stream_seq


async def _delete_quietly(objects: ObjectStore, name: str) -> None:
    with contextlib.suppress(Exception):  # already gone
        await objects.delete(name)
