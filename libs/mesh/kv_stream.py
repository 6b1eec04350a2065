"""KV events on NATS JetStream: the stream KVMESH_KV keeps every KVEventBatch published on kvmesh.kv.>, numbered by
the stream's own sequence, so a global index is rebuilt after a restart by replaying it.

    await ensure_kv_stream(bus)                 # idempotent; its owners (store nodes, balancers) create it
    follower = KVEventFollower(bus, index)      # replays the stream into `index`, then follows live batches
    await follower.start(); await follower.wait_caught_up(timeout_s=30)

Only the stream's owners may create it and its snapshot stores (`mesh.bus_auth`): a reader (prefill) that could
create them could also create them first with a configuration of its own (a short max_age, another subject).
A reader's follower (`create=False`) waits for the stream to exist (`start_eventually`).

Publishers may use plain NATS publishes (prefill's device events: many small batches, no need to wait for an
ack) or acknowledged JetStream publishes (store nodes); the stream captures both, as it listens on the subjects.
Retention: by age (the longest TTL plus a day) and bytes; a worker that starts sends `all_cleared` and then what it
holds, so an index never needs history older than a worker's own start. Compaction: a balancer's
`KVIndexCompactor` snapshots its index every so many messages and purges the stream below the snapshot; a
follower restores the latest snapshot first and replays only what came after it (`mesh.kv_snapshot`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.errors import NotFoundError

from mesh import kv_snapshot, metrics, subjects
from mesh.bus import Bus, jetstream_replicas
from mesh.kv_index import GlobalKVIndex, tier_mask
from mesh.logging import get_logger
from mesh.pb import events_pb2

STREAM = "KVMESH_KV"
MAX_AGE_S = 8 * 86_400.0
MAX_BYTES = 4 * 2**30
log = get_logger(__name__)


async def ensure_kv_stream(
    bus: Bus, max_age_s: float = MAX_AGE_S, max_bytes: int = MAX_BYTES, create: bool = True
) -> bool:
    """Create the stream if it does not exist (a stream with this name already there is left as it is). False when
    NATS has no JetStream: then events are plain NATS messages, and nothing can be replayed (indexes start empty);
    with `create=False` (a reader) also while nobody has created it yet."""
    js = bus.client.jetstream()
    try:
        try:
            await js.stream_info(STREAM)
            return True
        except NotFoundError:
            if not create:
                return False
        config = StreamConfig(
            name=STREAM,
            subjects=[subjects.ALL_KV_EVENTS],
            max_age=max_age_s,
            max_bytes=max_bytes,
            num_replicas=jetstream_replicas(),
        )
        try:
            await js.add_stream(config)
        except Exception:  # another role created it in between (or a config race): fine if it now exists
            await js.stream_info(STREAM)
        return True
    except Exception as exc:
        log.warning(
            "no JetStream stream for KV events: indexes cannot be rebuilt by replay",
            error=f"{type(exc).__name__}: {exc}",
        )
        return False


async def publish_acked(bus: Bus, batch: events_pb2.KVEventBatch, timeout_s: float = 5.0) -> int:
    """Publish one batch through JetStream; returns its stream sequence (raises when NATS does not ack)."""
    ack = await bus.client.jetstream().publish(
        subjects.kv_events(batch.worker_id), batch.SerializeToString(), timeout=timeout_s
    )
    return int(ack.seq)


class KVEventFollower:
    """Restores the latest index snapshot into `index` and replays KVMESH_KV from the message after it, then
    follows new batches. The only writer of `index` (besides `drop` from a registry's leave callback, on the same
    loop). `lag_s` is how old the last applied batch was when it arrived (publish to apply), the index's
    staleness. A gap in the stream's numbering means a compactor purged messages this follower had not read yet:
    it restores the newer snapshot and goes on from there."""

    def __init__(
        self, bus: Bus, index: GlobalKVIndex, tiers: frozenset[str] | None = None, create: bool = True
    ) -> None:
        self.bus = bus
        self.index = index
        self.create = create  # False: a reader, which may not create the stream or its snapshot stores
        self.tiers = tiers  # None: every tier; e.g. {"host", "ssd"}: store nodes only (a worker's batches share
        # one seq across its tiers, so a filter must take all the tiers a worker publishes, or see false gaps)
        self.last_stream_seq = 0  # the last stream message applied (or covered by the restored snapshot)
        self.lag_s = 0.0
        self.replay_seconds: float | None = None  # how long catching up took
        self.num_replayed = 0  # stream messages applied (not those a snapshot covered)
        self.num_restores = 0  # snapshots restored
        self.num_lost = 0  # stream messages skipped that no snapshot covered (aged out of the stream)
        self.num_forged = 0  # batches dropped: they named another worker than their subject
        self._target_seq = 0
        self._caught_up = asyncio.Event()
        self._started = 0.0
        self._subscription: Subscription | None = None
        self._resync: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Raises RuntimeError when NATS has no JetStream, or (a reader) nobody has created the stream yet; the
        caller goes on without an index."""
        if not await ensure_kv_stream(self.bus, create=self.create):
            raise RuntimeError("no KV event stream to follow (NATS has no JetStream, or no owner created it yet)")
        info = await self.bus.client.jetstream().stream_info(STREAM)
        self._target_seq = int(info.state.last_seq)
        self._started = time.monotonic()
        await self._subscribe()

    async def _subscribe(self) -> None:
        """Restore the latest snapshot (if any), then follow the stream from the message after it."""
        await self._follow_from(await self._latest_snapshot())

    async def start_eventually(self, retry_s: float = 1.0) -> None:
        """`start`, retried every `retry_s` until it succeeds (a reader waiting for the stream's owners)."""
        while True:
            try:
                await self.start()
                return
            except Exception as exc:
                log.debug("KV event stream not followable yet", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(retry_s)

    async def _latest_snapshot(self) -> events_pb2.KVIndexSnapshot | None:
        try:
            return await kv_snapshot.load_latest(self.bus, create=self.create)
        except Exception as exc:  # no snapshot store (or NATS briefly away): replay whatever the stream still has
            log.warning("KV index snapshot unreadable", error=f"{type(exc).__name__}: {exc}")
            return None

    async def _follow_from(self, snapshot: events_pb2.KVIndexSnapshot | None) -> None:
        if snapshot is not None:
            self.index.restore(snapshot, tier_mask(self.tiers))
            self.last_stream_seq = snapshot.stream_seq
            self.num_restores += 1
        if not self._caught_up.is_set() and self.last_stream_seq >= self._target_seq:
            self._mark_caught_up()
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.last_stream_seq + 1)
        self._subscription = await self.bus.client.jetstream().subscribe(
            subjects.ALL_KV_EVENTS,
            stream=STREAM,
            cb=self._on_message,
            ordered_consumer=True,
            config=config,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )

    async def stop(self) -> None:
        if self._resync is not None:
            self._resync.cancel()
            self._resync = None
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):  # the connection is already closing
                await self._subscription.unsubscribe()
            self._subscription = None

    @property
    def is_caught_up(self) -> bool:
        return self._caught_up.is_set()

    async def wait_caught_up(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._caught_up.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def _on_message(self, msg: Msg) -> None:
        if self._resync is not None:
            return  # a restore is under way: it subscribes again from its snapshot
        metadata = msg.metadata
        seq = int(metadata.sequence.stream)
        if seq > self.last_stream_seq + 1 and await self._restore_over_gap(seq):
            return
        self.last_stream_seq = seq
        batch = events_pb2.KVEventBatch()
        try:
            batch.ParseFromString(msg.data)
        except Exception:
            log.warning("undecodable KV event batch skipped", subject=msg.subject)
            return
        if self.tiers is None or batch.tier in self.tiers or not batch.tier:  # "": all_cleared of every tier
            worker_id = subjects.kv_events_worker(msg.subject, batch.worker_id)
            if worker_id is not None:  # else it names another worker than its subject: dropped
                self.index.apply(batch, worker_id)
            else:
                self.num_forged += 1
        self.num_replayed += 1
        if metadata.timestamp is not None:
            self.lag_s = max(0.0, time.time() - metadata.timestamp.timestamp())
            metrics.KV_INDEX_LAG_SECONDS.set(self.lag_s)
        metrics.KV_INDEX_BLOCKS.set(self.index.num_blocks())
        if not self._caught_up.is_set() and self.last_stream_seq >= self._target_seq:
            self._mark_caught_up()

    async def _restore_over_gap(self, seq: int) -> bool:
        """Messages up to `seq` - 1 are gone. True when a snapshot covers them (it is restored from outside this
        callback, which replaces the subscription); else they aged out, and the follower goes on without them.
        Each restore moves the follower past the gap, so gaps never loop."""
        snapshot = await self._latest_snapshot()
        if snapshot is not None and snapshot.stream_seq >= seq - 1:
            log.info(
                "KV stream compacted past this follower: restoring the snapshot",
                snapshot_seq=snapshot.stream_seq,
                applied_seq=self.last_stream_seq,
            )
            self._resync = asyncio.create_task(self._restore_again(snapshot))
            return True
        self.num_lost += seq - self.last_stream_seq - 1
        log.warning(
            "KV events aged out of the stream before this follower read them",
            num_messages=seq - self.last_stream_seq - 1,
        )
        return False

    async def _restore_again(self, snapshot: events_pb2.KVIndexSnapshot) -> None:
        try:
            await self._unsubscribe()
            await self._follow_from(snapshot)
        except Exception as exc:  # NATS away: the index stays as it was, as after a missed batch
            log.warning("KV index restore failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            self._resync = None

    def _mark_caught_up(self) -> None:
        self.replay_seconds = time.monotonic() - self._started
        self._caught_up.set()
        log.info(
            "KV index caught up",
            num_blocks=self.index.num_blocks(),
            seconds=round(self.replay_seconds, 3),
            stream_seq=self._target_seq,
        )


class KVIndexCompactor:
    """Every `every` stream messages a full follower (every tier) has applied, snapshot its index and purge the
    stream below the snapshot (`mesh.kv_snapshot`). Several balancer replicas may each run one: the snapshot
    pointer's compare-and-set keeps one winner per round."""

    def __init__(self, follower: KVEventFollower, every: int) -> None:
        if follower.tiers is not None:
            raise ValueError("only a follower of every tier holds the whole index to snapshot")
        if every < 1:
            raise ValueError(f"a snapshot every {every} messages: must be at least 1")
        self.follower = follower
        self.every = every
        self.snapshot_seq = 0  # the latest snapshot's seq, as last seen
        self.num_snapshots = 0  # written by this compactor

    def due(self) -> bool:
        return self.follower.is_caught_up and self.follower.last_stream_seq - self.snapshot_seq >= self.every

    async def compact(self) -> bool:
        """Snapshot now; True when it became the latest (the stream is then purged below it)."""
        follower = self.follower
        pointer = await kv_snapshot.latest(follower.bus)
        seq = follower.last_stream_seq
        if pointer.stream_seq >= seq:  # another replica's, or the one this follower restored
            self.snapshot_seq = pointer.stream_seq
            return False
        started = time.perf_counter()
        snapshot = follower.index.to_snapshot(seq)  # before any await: the index exactly as of message `seq`
        snapshot.timestamp_ms = int(time.time() * 1000)
        previous = await kv_snapshot.publish(follower.bus, snapshot, pointer)
        if previous is None:
            self.snapshot_seq = max(self.snapshot_seq, await kv_snapshot.latest_seq(follower.bus))
            return False
        await follower.bus.client.jetstream().purge_stream(STREAM, seq=seq + 1)  # every message below seq + 1
        self.snapshot_seq = seq
        self.num_snapshots += 1
        metrics.KV_INDEX_SNAPSHOTS.inc()
        log.info(
            "KV index snapshot taken; stream purged below it",
            seq=seq,
            replaced=previous,
            num_blocks=follower.index.num_blocks(),
            bytes=snapshot.ByteSize(),
            seconds=round(time.perf_counter() - started, 3),
        )
        return True

    async def run_forever(self, interval_s: float) -> None:
        """Compact whenever due. The first round after a restart may find the latest snapshot is already as new
        as its index (restored from it): `compact` then only learns its seq."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                if self.due():
                    await self.compact()
            except Exception as exc:  # NATS away for a moment: the next round tries again
                log.warning("KV index snapshot failed", error=f"{type(exc).__name__}: {exc}")
