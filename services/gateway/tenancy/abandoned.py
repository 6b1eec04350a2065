"""Requests whose gateway died: settled as "aborted", billed for the tokens their decode workers emitted.

A request that started generating has an open record (ledger.py: open_requests) naming its gateway process. Its
own record normally follows and removes it. When the gateway is SIGKILLed mid-stream, no record ever comes; the
decode worker sees its stream cancelled, stops the request and publishes RequestFinished (finish_reason "abort",
the tokens it generated) on kvmesh.requests.finished, which the JetStream stream KVMESH_FINISHED keeps (it
captures that subject; decode publishes through an outbox, acknowledged by the stream, so one published while NATS
was away arrives when it returns). Every gateway runs an AbandonedRequests sweeper; it settles
an open request when either

- its gateway process is gone (no heartbeat from that worker id with that start time, after this sweeper has
  listened for `warmup_s`) and its decode worker reported the request finished; or
- its `settle_after` passed (the request timeout and a margin: it cannot still be running), whatever was heard.

The aborted record sums `num_output_tokens` over every RequestFinished of the request's attempts and choices (ids
`<request_id>`, `<request_id>-<choice>`, then `.<retry>` or `.m<migration>` suffixes), priced at settlement like
any record. Two sweepers racing write it once: the usage_records primary key. The dead gateway's reservations
are not settled: its tokens stay counted in their windows (never fewer than were used) and its concurrency
slots expire with their lease (limits.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from sqlalchemy import select

from mesh import subjects
from mesh.bus import Bus, jetstream_replicas
from mesh.logging import get_logger
from mesh.pb import events_pb2
from mesh.tasks import cancel_until_done
from services.gateway.tenancy import schema
from services.gateway.tenancy.db import Database
from services.gateway.tenancy.ledger import ensure_stream, settle

FINISHED_STREAM = subjects.FINISHED_STREAM
FINISHED_MAX_AGE_S = 3600.0  # longer than a request may live (request_timeout_s) plus the sweeper's margin
FINISHED_MAX_BYTES = 256 * 2**20  # the oldest go first past it
GRACE_S = 5.0  # an open record younger than this is never judged: its gateway's heartbeat may be on the way
MAX_ROWS = 1000  # open requests judged per sweep
ABORTED = "aborted"
log = get_logger(__name__)

Gateway = tuple[str, int]  # a gateway process: worker id, start time (unix ms)


async def ensure_finished_stream(js: JetStreamContext) -> None:
    """Keep every RequestFinished for an hour (limits retention: nothing consumes them away)."""
    config = StreamConfig(
        name=FINISHED_STREAM,
        subjects=[subjects.REQUESTS_FINISHED],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=FINISHED_MAX_AGE_S,
        max_bytes=FINISHED_MAX_BYTES,
        num_replicas=jetstream_replicas(),
    )
    await ensure_stream(js, config)


def attempt_pattern(request_id: str) -> re.Pattern[str]:
    """The ids a request's attempts go by on the workers (gateway: chat.py choices, pipeline.py retries)."""
    return re.compile(rf"{re.escape(request_id)}(-\d{{1,4}})?(\.(\d{{1,4}}|m\d{{1,4}}))*")


@dataclass
class Emitted:
    """What the decode workers reported of one request's attempts."""

    num_tokens: int = 0
    decode_worker: str = ""
    ended_at_ms: int = 0
    attempts: list[str] = field(default_factory=list)

    def add(self, finished: events_pb2.RequestFinished) -> None:
        self.num_tokens += finished.num_output_tokens
        self.attempts.append(finished.request_id)
        if finished.timestamp_ms >= self.ended_at_ms:
            self.ended_at_ms, self.decode_worker = finished.timestamp_ms, finished.worker_id


def match_emitted(request_ids: Iterable[str], finished: Iterable[events_pb2.RequestFinished]) -> dict[str, Emitted]:
    """The RequestFinished events of each request (by its attempts' ids); requests with none are left out."""
    patterns = {request_id: attempt_pattern(request_id) for request_id in request_ids}
    found: dict[str, Emitted] = {}
    for event in finished:
        attempt = event.request_id
        cuts = [len(attempt)] + [i for i, char in enumerate(attempt) if char in "-."]  # where a suffix may start
        for cut in cuts:
            pattern = patterns.get(attempt[:cut])
            if pattern is not None and pattern.fullmatch(attempt):
                found.setdefault(attempt[:cut], Emitted()).add(event)
                break
    return found


def aborted_record(opened: events_pb2.UsageRecord, emitted: Emitted | None, now_ms: int) -> events_pb2.UsageRecord:
    """The record of a request whose gateway died: its open record, with what the decode workers emitted."""
    record = events_pb2.UsageRecord()
    record.CopyFrom(opened)
    record.status = ABORTED
    record.http_status = 0  # the client got what the stream had carried, then a broken connection
    record.ClearField("gateway_id")
    record.ClearField("gateway_started_at_ms")
    record.ClearField("settle_after_ms")
    if emitted is not None:
        record.completion_tokens = emitted.num_tokens
        record.decode_worker = emitted.decode_worker or record.decode_worker
    record.ended_at_ms = emitted.ended_at_ms if emitted is not None and emitted.ended_at_ms else now_ms
    record.e2e_ms = max(0, record.ended_at_ms - record.started_at_ms)
    return record


class AbandonedRequests:
    """One per gateway. `live_gateways()`: the gateway processes heard from lately (heartbeats)."""

    def __init__(
        self,
        bus: Bus,
        database: Database,
        live_gateways: Callable[[], set[Gateway]],
        *,
        interval_s: float = 5.0,
        warmup_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.database = database
        self.live_gateways = live_gateways
        self.interval_s = interval_s
        self.warmup_s = warmup_s  # heartbeats of every live gateway have reached this process by then
        self.clock = clock
        self.num_settled = 0
        self._listening_since = clock()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._listening_since = self.clock()
        try:
            await ensure_finished_stream(self.bus.client.jetstream())
        except Exception as exc:  # NATS away: made on a later sweep
            log.warning("finished-requests stream not made yet", error=f"{type(exc).__name__}: {exc}")
        self._task = asyncio.create_task(self._run(), name="abandoned-requests")

    async def stop(self) -> None:
        await cancel_until_done(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS or the database away: the next sweep tries again
                log.warning("settling abandoned requests failed", error=f"{type(exc).__name__}: {exc}")

    async def sweep(self) -> int:
        """Settle what is due; returns how many records this sweep wrote."""
        now = self.clock()
        opened = schema.open_requests
        async with self.database.engine.connect() as connection:
            rows = (
                await connection.execute(
                    select(opened)
                    .where(opened.c.started_at <= dt.datetime.fromtimestamp(now - GRACE_S, tz=dt.UTC))
                    .order_by(opened.c.started_at)
                    .limit(MAX_ROWS)
                )
            ).all()
        if not rows:
            return 0
        is_listening = self.bus.is_connected and now - self._listening_since >= self.warmup_s
        live = self.live_gateways() if is_listening else set()
        overdue = [row for row in rows if row.settle_after.timestamp() <= now]
        orphans = [
            row
            for row in rows
            if row.settle_after.timestamp() > now
            and is_listening
            and (row.gateway_id, row.gateway_started_at_ms) not in live
        ]
        if not overdue and not orphans:
            return 0
        since = min(row.started_at for row in overdue + orphans)
        emitted = match_emitted([row.request_id for row in overdue + orphans], await self._finished_since(since))
        due = overdue + [row for row in orphans if row.request_id in emitted]
        if not due:
            return 0
        now_ms = int(now * 1000)
        records = []
        for row in due:
            record = events_pb2.UsageRecord()
            record.ParseFromString(row.record)
            records.append(aborted_record(record, emitted.get(row.request_id), now_ms))
        num_new = await self.database.transaction(lambda connection: settle(connection, records))
        self.num_settled += num_new
        log.info("abandoned requests settled", count=num_new, request_ids=[r.request_id for r in due][:10])
        return num_new

    async def _finished_since(self, since: dt.datetime) -> list[events_pb2.RequestFinished]:
        """Every RequestFinished kept since `since` (an ephemeral consumer, read to the end, then deleted)."""
        js = self.bus.client.jetstream()
        await ensure_finished_stream(js)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=since - dt.timedelta(seconds=1),
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
        )
        subscription = await js.pull_subscribe(subjects.REQUESTS_FINISHED, stream=FINISHED_STREAM, config=config)
        found: list[events_pb2.RequestFinished] = []
        try:
            while True:
                try:
                    messages: list[Any] = await subscription.fetch(1000, timeout=1.0)
                except (asyncio.TimeoutError, nats.errors.TimeoutError):
                    break  # nothing (more) kept since then
                for message in messages:
                    event = events_pb2.RequestFinished()
                    event.ParseFromString(message.data)
                    found.append(event)
                if messages[-1].metadata.num_pending == 0:
                    break
        finally:
            await subscription.unsubscribe()
        return found
