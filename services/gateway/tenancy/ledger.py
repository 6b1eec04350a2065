"""The usage ledger: exactly one UsageRecord per request, from the gateway that served it to the usage_records table.

    publisher = UsagePublisher(bus); await publisher.start()   # every gateway: telemetry.RequestRecord submits
    consumer = LedgerConsumer(bus, database); await consumer.start()   # every gateway: they share one consumer

1. A request ends (telemetry.RequestRecord.finish): its record goes into the publisher's bounded queue; `submit`
   never blocks nor raises, so the client never waits for the ledger.
2. The publisher sends it to the JetStream stream KVMESH_USAGE (file storage) with `Nats-Msg-Id` = request id,
   retrying while NATS is away; a retry of a record NATS already stored is dropped by the stream's duplicate
   window. Past the queue's bound a record is dropped, counted and logged; a graceful stop flushes the queue.
3. The durable pull consumer `ledger` (one for all replicas: each message goes to one of them) prices each record
   from the prices table (the tenant's price_plan and the model; Decimal), inserts it with ON CONFLICT DO NOTHING
   on request_id (a redelivered record is written once) and acks only after the commit.
4. A request that started generating is announced by an "open" record first (telemetry.RequestRecord.start); the
   consumer keeps it in open_requests until the request's own record comes, in the same transaction. One whose
   gateway died never gets its record: abandoned.py settles it as "aborted". The open record waits
   OPEN_RECORD_DELAY_S before it is queued (dropped if the request's own record comes first): its publish, NATS
   storing it and the consumer's SQLite transaction otherwise took both cores in the very milliseconds the client
   needed one to read its first token (about 3 ms of TTFT at C=1: docs/benchmarks.md#where-the-overhead-goes).
5. For the same reason the consumer lingers (as Kafka's producers do): a fetch that did not fill a batch waits
   LINGER_S for more records before its transaction, so records are written in batches, and never in the
   milliseconds after a request ended, when a client's next request needs the gateway (C=1 back to back: docs/
   benchmarks.md#the-ledger-lingers). A full batch does not wait; a record reaches the table within LINGER_S
   and one transaction of JetStream storing it (ack_wait, 5 s, is far longer).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import time
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NoStreamResponseError, NotFoundError
from sqlalchemy import Table, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from mesh import subjects
from mesh.bus import Bus, jetstream_replicas
from mesh.logging import get_logger
from mesh.metrics import USAGE_DROPPED, USAGE_PUBLISHED, USAGE_QUEUED, USAGE_WRITTEN
from mesh.pb import events_pb2
from mesh.tasks import cancel_until_done
from services.gateway.tenancy import schema
from services.gateway.tenancy.db import Database
from services.gateway.tenancy.pricing import TokenPrice

STREAM = "KVMESH_USAGE"
CONSUMER = "ledger"
DUPLICATE_WINDOW_S = 300.0  # a retry within it is dropped by the stream; past it, by the table's primary key
MSG_ID_HEADER = "Nats-Msg-Id"
DROP_LOG_INTERVAL_S = 10.0
LINGER_S = 0.5  # how long the consumer holds a batch that did not fill for more records (5. above)
DEFAULT_PLAN = "default"  # a tenant without a row (the `default` tenant of KVMESH_API_KEYS) is priced by it
STATUSES = ("finished", "client_gone", "failed", "timeout", "aborted", "refused")
OPEN = "open"  # the status of an open record: the request started generating (not a ledger status)
OPEN_RECORD_DELAY_S = 0.02  # an open record is queued this long after the first token went out (module docstring)
log = get_logger(__name__)


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream `config` names if it does not exist (replicas race to: the loser finds it made)."""
    try:
        await js.stream_info(config.name or "")
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(config)
    except Exception:  # another replica created it in between: fine if it now exists
        await js.stream_info(config.name or "")


async def ensure_usage_stream(js: JetStreamContext) -> None:
    """KVMESH_USAGE: a work queue (a message leaves once the ledger acks it)."""
    config = StreamConfig(
        name=STREAM,
        subjects=[subjects.ALL_USAGE],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
        num_replicas=jetstream_replicas(),
    )
    await ensure_stream(js, config)


# ---- publishing ----------------------------------------------------------------------------------------------


class UsagePublisher:
    """The only reader of its queue is its pump task; `submit` (on the same loop) is the only writer."""

    def __init__(
        self,
        bus: Bus,
        max_queued: int = 100_000,
        max_in_flight: int = 64,
        ack_timeout_s: float = 2.0,
        *,
        gateway: tuple[str, int] = ("", 0),
        settle_after_s: float = 660.0,
        open_delay_s: float = OPEN_RECORD_DELAY_S,
    ) -> None:
        self.bus = bus
        self.gateway_id, self.gateway_started_at_ms = gateway  # this process: its worker id and start (open records)
        self.settle_after_s = settle_after_s  # an open record's request is settled by then, its gateway alive or not
        self.max_queued = max_queued
        self.max_in_flight = max_in_flight
        self.ack_timeout_s = ack_timeout_s
        self.num_published = 0
        self.num_dropped = 0
        self.num_retries = 0  # publishes that failed (NATS away, no ack in time) and went back in the queue
        self.open_delay_s = open_delay_s
        self._queue: collections.deque[events_pb2.UsageRecord] = collections.deque()
        # open records waiting out open_delay_s, by request id; written only by submit_open, submit and close
        self._delayed_opens: dict[str, tuple[events_pb2.UsageRecord, asyncio.TimerHandle]] = {}
        self._num_in_flight = 0
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._is_closed = False
        self._num_unlogged_drops = 0
        self._last_drop_log = -DROP_LOG_INTERVAL_S

    @property
    def num_queued(self) -> int:
        return len(self._queue) + self._num_in_flight

    def submit(self, record: events_pb2.UsageRecord) -> None:
        """Queue one record; never blocks, never raises. A request's own record makes its delayed open one moot."""
        if record.status != OPEN and (delayed := self._delayed_opens.pop(record.request_id, None)) is not None:
            delayed[1].cancel()
        if self._is_closed:
            self._drop(1, "the usage publisher is closed", record.request_id)
            return
        if len(self._queue) >= self.max_queued:
            self._drop(1, "the usage queue is full", record.request_id)
            return
        self._queue.append(record)
        USAGE_QUEUED.set(self.num_queued)
        self._wake.set()

    def submit_open(self, record: events_pb2.UsageRecord) -> None:
        """Queue the open record of a request that started generating (status OPEN), naming this gateway."""
        record.status = OPEN
        record.gateway_id, record.gateway_started_at_ms = self.gateway_id, self.gateway_started_at_ms
        record.settle_after_ms = record.started_at_ms + int(self.settle_after_s * 1000)
        if self.open_delay_s <= 0 or self._is_closed or record.request_id in self._delayed_opens:
            self.submit(record)
            return
        handle = asyncio.get_running_loop().call_later(self.open_delay_s, self._submit_delayed, record.request_id)
        self._delayed_opens[record.request_id] = (record, handle)

    def _submit_delayed(self, request_id: str) -> None:
        delayed = self._delayed_opens.pop(request_id, None)
        if delayed is not None:
            self.submit(delayed[0])

    def _submit_all_delayed(self) -> None:
        for request_id in list(self._delayed_opens):
            self._delayed_opens[request_id][1].cancel()
            self._submit_delayed(request_id)

    async def start(self) -> None:
        with contextlib.suppress(Exception):  # NATS away: the pump creates the stream once it is back
            await ensure_usage_stream(self.bus.client.jetstream())
        self._pump = asyncio.create_task(self._run(), name="usage-publisher")

    async def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (up to `timeout_s`), then stop; what is left is dropped, counted and logged."""
        self._submit_all_delayed()
        self._is_closed = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.num_queued and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await cancel_until_done(self._pump)
        if self._queue:
            self._drop(len(self._queue), "the gateway stopped before NATS took them", self._queue[0].request_id)
            self._queue.clear()

    def _drop(self, count: int, why: str, request_id: str) -> None:
        """Count every drop; log at most one line per DROP_LOG_INTERVAL_S (a full queue drops at request rate)."""
        self.num_dropped += count
        self._num_unlogged_drops += count
        USAGE_DROPPED.inc(count)
        now = time.monotonic()
        if now - self._last_drop_log >= DROP_LOG_INTERVAL_S:
            log.warning("usage records dropped", count=self._num_unlogged_drops, why=why, last_request_id=request_id)
            self._num_unlogged_drops = 0
            self._last_drop_log = now

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            batch = [self._queue.popleft() for _ in range(min(self.max_in_flight, len(self._queue)))]
            self._num_in_flight = len(batch)
            results = await asyncio.gather(*(self._publish(record) for record in batch), return_exceptions=True)
            failed = [record for record, result in zip(batch, results, strict=True) if result is not None]
            self._queue.extendleft(reversed(failed))  # retried first, in their order
            self._num_in_flight = 0
            USAGE_QUEUED.set(self.num_queued)
            if failed:
                self.num_retries += len(failed)
                if any(isinstance(r, (nats.errors.NoRespondersError, NoStreamResponseError)) for r in results):
                    with contextlib.suppress(Exception):  # a NATS without the stream (a new store): make it again
                        await ensure_usage_stream(self.bus.client.jetstream())
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            else:
                backoff = 0.05

    async def _publish(self, record: events_pb2.UsageRecord) -> None:
        await self.bus.client.jetstream().publish(
            subjects.usage(record.tenant_id),
            record.SerializeToString(),
            timeout=self.ack_timeout_s,
            headers={MSG_ID_HEADER: message_id(record)},
        )
        self.num_published += 1
        USAGE_PUBLISHED.inc()


def message_id(record: events_pb2.UsageRecord) -> str:
    """The stream's deduplication id: the request id, and for its open record the request id + ":open"."""
    return f"{record.request_id}:{OPEN}" if record.status == OPEN else record.request_id


# ---- settlement ----------------------------------------------------------------------------------------------


def cost(record: events_pb2.UsageRecord, price: Any | None) -> Decimal:
    """Dollars, by the one cost function (pricing.TokenPrice.cost) that spend budgets count by too. `price`: the
    prices-table row of the record's plan and model; none: 0."""
    if price is None:
        return Decimal(0)
    return TokenPrice.of_row(price).cost(record.prompt_tokens, record.cached_tokens, record.completion_tokens)


def _time(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def row(record: events_pb2.UsageRecord, plan: str, price: Any | None) -> dict[str, Any]:
    """The usage_records row of a record, priced by `plan`."""
    return {
        "request_id": record.request_id,
        "tenant_id": record.tenant_id,
        "key_id": record.key_id,
        "model": record.model,
        "api": record.api,
        "status": record.status,
        "http_status": record.http_status,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_ms": record.ttft_ms if record.HasField("ttft_ms") else None,
        "e2e_ms": record.e2e_ms,
        "prefill_worker": record.prefill_worker or None,
        "decode_worker": record.decode_worker or None,
        "cost": cost(record, price),
        "price_plan": plan,
        "started_at": _time(record.started_at_ms),
        "ended_at": _time(record.ended_at_ms),
    }


def settle(connection: Connection, records: Sequence[events_pb2.UsageRecord]) -> int:
    """Price and insert `records` in the caller's transaction, and close their open requests; returns how many were
    new (the rest were there)."""
    unique = list({record.request_id: record for record in records}.values())
    if not unique:
        return 0
    opened = schema.open_requests
    connection.execute(opened.delete().where(opened.c.request_id.in_([record.request_id for record in unique])))
    tenants = schema.tenants
    tenant_ids = {record.tenant_id for record in unique}
    result = connection.execute(select(tenants.c.id, tenants.c.price_plan).where(tenants.c.id.in_(tenant_ids)))
    plans: dict[str, str] = {tenant_id: plan for tenant_id, plan in result}
    prices = schema.prices
    price_rows = connection.execute(select(prices).where(prices.c.plan.in_(set(plans.values()) | {DEFAULT_PLAN}))).all()
    by_key = {(price.plan, price.model): price for price in price_rows}
    rows = []
    for record in unique:
        plan = plans.get(record.tenant_id, DEFAULT_PLAN)
        rows.append(row(record, plan, by_key.get((plan, record.model))))
    return _insert_new(connection, schema.usage_records, rows)


def remember_open(connection: Connection, records: Sequence[events_pb2.UsageRecord]) -> int:
    """Keep the open records of requests that have no usage record yet (in the caller's transaction); returns how
    many were new. One that comes after its request's record is dropped."""
    unique = {record.request_id: record for record in records}
    if not unique:
        return 0
    usage = schema.usage_records
    done = connection.execute(select(usage.c.request_id).where(usage.c.request_id.in_(list(unique))))
    for (request_id,) in done:
        del unique[request_id]
    if not unique:
        return 0
    rows = [
        {
            "request_id": record.request_id,
            "gateway_id": record.gateway_id,
            "gateway_started_at_ms": record.gateway_started_at_ms,
            "started_at": _time(record.started_at_ms),
            "settle_after": _time(record.settle_after_ms),
            "record": record.SerializeToString(),
        }
        for record in unique.values()
    ]
    return _insert_new(connection, schema.open_requests, rows)


def _insert_new(connection: Connection, table: Table, rows: list[dict[str, Any]]) -> int:
    """Insert the rows whose request_id is not in `table` yet; returns how many were. The statement is the same
    for any number of rows, so SQLAlchemy compiles it once per table (a statement with the rows as its VALUES was
    compiled again for every batch: most of the transaction's CPU); RETURNING counts the new rows on both backends,
    where an executemany's rowcount is not reliable."""
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(table).on_conflict_do_nothing(index_elements=["request_id"])
    return len(connection.execute(statement.returning(table.c.request_id), rows).all())


def settle_batch(
    connection: Connection, records: Sequence[events_pb2.UsageRecord], opened: Sequence[events_pb2.UsageRecord]
) -> int:
    """One fetched batch in one transaction: its records settled, then its open records kept; returns how many
    records were new."""
    num_new = settle(connection, records)
    remember_open(connection, opened)
    return num_new


# ---- the consumer --------------------------------------------------------------------------------------------


class LedgerConsumer:
    """Moves records from KVMESH_USAGE into usage_records; the only writer of that table."""

    def __init__(
        self,
        bus: Bus,
        database: Database,
        batch_size: int = 256,
        ack_wait_s: float = 5.0,
        linger_s: float = LINGER_S,
    ) -> None:
        self.bus = bus
        self.database = database
        self.batch_size = batch_size
        self.ack_wait_s = ack_wait_s
        self.linger_s = linger_s
        self.num_written = 0
        self.num_duplicates = 0
        self.num_batches = 0  # transactions
        self._task: asyncio.Task[None] | None = None
        self._subscription: JetStreamContext.PullSubscription | None = None  # only the task replaces it
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        self._stopping = asyncio.Event()
        try:
            self._subscription = await self._subscribe()
        except Exception as exc:  # NATS away: the task subscribes once it is back
            log.warning("ledger consumer not subscribed yet", error=f"{type(exc).__name__}: {exc}")
        self._task = asyncio.create_task(self._run(), name="ledger-consumer")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop after the batch in hand is committed and acked (up to `grace_s`; 0: at once, as a crash would).
        A batch fetched but not committed is redelivered, to any replica, after ack_wait_s (a batch being written
        says so every ack_wait_s / 3, so a slow database never gets it redelivered meanwhile)."""
        if self._task is None:
            return
        self._stopping.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._task), grace_s if grace_s > 0 else 0.0)
        await cancel_until_done(self._task)
        self._task = None
        await self._unsubscribe()

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        js = self.bus.client.jetstream()
        await ensure_usage_stream(js)
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s, max_ack_pending=-1)
        return await js.pull_subscribe(subjects.ALL_USAGE, durable=CONSUMER, stream=STREAM, config=config)

    async def _unsubscribe(self) -> None:
        """Leaves the durable consumer on the server (the other replicas go on with it)."""
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if self._subscription is None:
                    self._subscription = await self._subscribe()
                try:
                    messages = await self._subscription.fetch(self.batch_size, timeout=1.0)
                except (asyncio.TimeoutError, nats.errors.TimeoutError):
                    continue
                if len(messages) < self.batch_size:
                    messages += await self._more(self._subscription, self.batch_size - len(messages))
                await self._write(messages)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS or the database away: try again shortly, from a fresh subscription
                log.warning("ledger consumer retrying", error=f"{type(exc).__name__}: {exc}")
                await self._unsubscribe()
                await asyncio.sleep(0.5)

    async def _more(self, subscription: JetStreamContext.PullSubscription, room: int) -> list[Msg]:
        """The records that came within linger_s of a batch's first (up to `room`); a stop ends the wait early."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), self.linger_s)
        try:
            return await subscription.fetch(room, timeout=0.05)  # what JetStream holds now: no wait for more
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            return []

    async def _still_working(self, messages: list[Msg]) -> None:
        """Tell JetStream the batch is being written (+WPI resets each message's ack_wait), until cancelled."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            await asyncio.gather(*(message.in_progress() for message in messages), return_exceptions=True)

    async def _write(self, messages: Iterable[Msg]) -> None:
        records: list[events_pb2.UsageRecord] = []
        opened: list[events_pb2.UsageRecord] = []
        acks: list[Msg] = []
        for message in messages:
            record = events_pb2.UsageRecord()
            try:
                record.ParseFromString(message.data)
            except Exception:
                log.warning("undecodable usage record dropped", subject=message.subject)
                await message.term()
                continue
            (opened if record.status == OPEN else records).append(record)
            acks.append(message)
        working = asyncio.create_task(self._still_working(acks))
        try:
            num_new = await self.database.transaction(lambda connection: settle_batch(connection, records, opened))
        finally:
            await cancel_until_done(working)
        for message in acks:  # only after the commit: a crash before this redelivers, and the insert skips them
            await message.ack()
        self.num_batches += 1
        self.num_written += num_new
        self.num_duplicates += len(records) - num_new
        USAGE_WRITTEN.labels("written").inc(num_new)
        USAGE_WRITTEN.labels("duplicate").inc(len(records) - num_new)
