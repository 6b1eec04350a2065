"""KV events on NATS JetStream: the stream KVMESH_KV keeps every KVEventBatch published on kvmesh.kv.>, numbered by
the stream's own sequence, so a global index is rebuilt after a restart by replaying it.

    await ensure_kv_stream(bus)                 # idempotent; every role that publishes or follows calls it
    follower = KVEventFollower(bus, index)      # replays the stream into `index`, then follows live batches
    await follower.start(); await follower.wait_caught_up(timeout_s=30)

Publishers may use plain NATS publishes (prefill's device events: many small batches, no need to wait for an
ack) or acknowledged JetStream publishes (store nodes); the stream captures both, as it listens on the subjects.
Retention: by age (the longest TTL plus a day) and bytes; a worker that starts sends `all_cleared` and then what it
holds, so an index never needs history older than a worker's own start.
"""

from __future__ import annotations

import asyncio
import time

from nats.js.api import DeliverPolicy, StreamConfig
from nats.js.errors import NotFoundError
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh import metrics, subjects
from mesh.bus import Bus
from mesh.kv_index import GlobalKVIndex
from mesh.logging import get_logger
from mesh.pb import events_pb2

STREAM = "KVMESH_KV"
MAX_AGE_S = 8 * 86_400.0
MAX_BYTES = 4 * 2**30
log = get_logger(__name__)


async def ensure_kv_stream(bus: Bus, max_age_s: float = MAX_AGE_S, max_bytes: int = MAX_BYTES) -> bool:
    """Create the stream if it does not exist (a stream with this name already there is left as it is). False when
    NATS has no JetStream: then events are plain NATS messages, and nothing can be replayed (indexes start empty)."""
    js = bus.client.jetstream()
    try:
        try:
            await js.stream_info(STREAM)
            return True
        except NotFoundError:
            pass
        config = StreamConfig(name=STREAM, subjects=[subjects.ALL_KV_EVENTS], max_age=max_age_s, max_bytes=max_bytes)
        try:
            await js.add_stream(config)
        except Exception:  # another role created it in between (or a config race): fine if it now exists
            await js.stream_info(STREAM)
        return True
    except Exception as exc:
        log.warning("no JetStream stream for KV events: indexes cannot be rebuilt by replay",
                    error=f"{type(exc).__name__}: {exc}")
        return False


async def publish_acked(bus: Bus, batch: events_pb2.KVEventBatch, timeout_s: float = 5.0) -> int:
    """Publish one batch through JetStream; returns its stream sequence (raises when NATS does not ack)."""
    ack = await bus.client.jetstream().publish(subjects.kv_events(batch.worker_id), batch.SerializeToString(),
                                                timeout=timeout_s)
    return int(ack.seq)


class KVEventFollower:
    """Replays KVMESH_KV into `index` from the first message, then follows new batches. The only writer of `index`
    (besides `drop` from a registry's leave callback, on the same loop). `lag_s` is how old the last applied batch
    was when it arrived (publish to apply), the index's staleness."""

    def __init__(self, bus: Bus, index: GlobalKVIndex, tiers: frozenset[str] | None = None) -> None:
        self.bus = bus
        self.index = index
        self.tiers = tiers  # None: every tier; e.g. {"host", "ssd"}: store nodes only (a worker's batches share
        # one seq across its tiers, so a filter must take all the tiers a worker publishes, or see false gaps)
        self.last_stream_seq = 0
        self.lag_s = 0.0
        self.replay_seconds: float | None = None  # how long catching up took
        self._target_seq = 0
        self._caught_up = asyncio.Event()
        self._started = 0.0
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        """Raises RuntimeError when NATS has no JetStream (the caller goes on without an index)."""
        if not await ensure_kv_stream(self.bus):
            raise RuntimeError("NATS has no JetStream: no KV event stream to follow")
        js = self.bus.client.jetstream()
        info = await js.stream_info(STREAM)
        self._target_seq = int(info.state.last_seq)
        self._started = time.monotonic()
        if self._target_seq == 0:
            self._mark_caught_up()
        self._subscription = await js.subscribe(subjects.ALL_KV_EVENTS, stream=STREAM, cb=self._on_message,
                                                ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
                                                pending_msgs_limit=-1, pending_bytes_limit=-1)

    async def stop(self) -> None:
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except Exception:  # the connection is already closing
                pass
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
        batch = events_pb2.KVEventBatch()
        try:
            batch.ParseFromString(msg.data)
        except Exception:
            log.warning("undecodable KV event batch skipped", subject=msg.subject)
            return
        metadata = msg.metadata
        self.last_stream_seq = int(metadata.sequence.stream)
        if self.tiers is None or batch.tier in self.tiers or not batch.tier:  # "": all_cleared of every tier
            worker_id = batch.worker_id or msg.subject.removeprefix(subjects.KV_EVENTS_PREFIX + ".")
            self.index.apply(batch, worker_id)
        if metadata.timestamp is not None:
            self.lag_s = max(0.0, time.time() - metadata.timestamp.timestamp())
            metrics.KV_INDEX_LAG_SECONDS.set(self.lag_s)
        metrics.KV_INDEX_BLOCKS.set(self.index.num_blocks())
        if not self._caught_up.is_set() and self.last_stream_seq >= self._target_seq:
            self._mark_caught_up()

    def _mark_caught_up(self) -> None:
        self.replay_seconds = time.monotonic() - self._started
        self._caught_up.set()
        log.info("KV index caught up", num_blocks=self.index.num_blocks(), seconds=round(self.replay_seconds, 3),
                 stream_seq=self._target_seq)
