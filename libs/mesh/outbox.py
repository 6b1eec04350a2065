"""Events for the bus, kept while it is away: a bounded queue that one task sends in order.

A publisher `put`s and goes on at once (a Put of KV never waits on NATS). The sending task waits while the bus is
disconnected and sends the head of the queue until it goes through, so what was published during an outage
arrives, in order, when NATS returns. On a subject a JetStream stream captures, a send is a JetStream publish,
acknowledged, with the message's `Nats-Msg-Id`: a send that was stored but whose ack was lost is retried, and the
stream keeps one copy (its duplicate window, two minutes by default). On a plain subject (`jetstream=False`) a send
is a core publish, which the client buffers while it reconnects; the id still travels in the header, so a stream
that captures the subject drops a second copy all the same. Where the stream is another role's and may not exist
yet (`stream`: decode's finished requests go to the gateway's KVMESH_FINISHED), the outbox asks whether it does
and sends core publishes, with the id, until it is made: a JetStream publish that no stream captures gets no ack
(core subscribers take it and answer nothing), and would be sent again forever.

The queue holds at most `capacity` messages. One more, and the queue is dropped whole and `resync` (the
publisher's full state, for example a store node's `all_cleared` and then every block it holds) is sent first when
the bus returns; what was `put` meanwhile is dropped too, since the resync covers it. Without a `resync`, the
oldest message makes room and is lost (counted).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import nats.js.errors

from mesh import metrics
from mesh.bus import Bus
from mesh.logging import get_logger
from mesh.tasks import cancel_until_done

log = get_logger(__name__)
MSG_ID = "Nats-Msg-Id"
STREAM_RECHECK_S = 5.0  # how often an outbox whose stream is missing asks again whether it was made


@dataclass(frozen=True)
class Envelope:
    subject: str
    payload: bytes
    msg_id: str  # unique per message of this process: the stream's dedupe key
    headers: Mapping[str, str] | None = None  # sent with it (a request id, the sender's traceparent)


class Outbox:
    """One writer of `_queue`'s head: the sending task; `put` (same loop) appends."""

    def __init__(
        self,
        bus: Bus,
        capacity: int,
        *,
        jetstream: bool = True,
        resync: Callable[[], list[Envelope]] | None = None,
        ack_timeout_s: float = 2.0,
        retry_s: float = 0.25,
        stream: str | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be at least 1")
        self.bus = bus
        self.capacity = capacity
        self.jetstream = jetstream
        self.resync = resync
        self.ack_timeout_s = ack_timeout_s
        self.retry_s = retry_s
        self.stream = stream  # the stream that captures the subjects where it may not exist (None: it does)
        self.needs_resync = False  # the queue overflowed: `resync` goes out first when the bus is back
        self.num_sent = 0
        self.num_retries = 0  # sends that failed and were tried again
        self.num_dropped = 0  # messages dropped on overflow (covered by a resync where there is one)
        self.num_resyncs = 0
        self.num_unacked = 0  # sent as core publishes: `stream` did not exist
        self.max_len = 0  # the longest the queue has been
        self._stream_checked: tuple[float, int, bool] | None = None  # (when, bus.num_disconnects then, it exists)
        self._queue: deque[Envelope] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, envelope: Envelope) -> bool:
        """Queue one message; False when it was dropped (the queue overflowed)."""
        if self.needs_resync:
            self.num_dropped += 1
            return False
        if len(self._queue) >= self.capacity:
            if self.resync is None:
                self._queue.popleft()
                self.num_dropped += 1
                if self.num_dropped % 1000 == 1:
                    log.warning("outbox full: its oldest messages are dropped", num_dropped=self.num_dropped)
            else:
                self.num_dropped += len(self._queue) + 1
                self._queue.clear()
                self.needs_resync = True
                self._wake.set()
                log.warning("outbox overflowed: the publisher's state will be sent again", capacity=self.capacity)
                return False
        self._queue.append(envelope)
        self.max_len = max(self.max_len, len(self._queue))
        self._wake.set()
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued has been sent; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._queue or self.needs_resync:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to `timeout_s`), then stop."""
        if not await self.flush(timeout_s):
            log.warning("outbox not empty at stop: messages lost", num_pending=len(self._queue))
        await cancel_until_done(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            if not self._queue and not self.needs_resync:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self.bus.connected.wait()
            if self.needs_resync and self.resync is not None:
                self.needs_resync = False
                self._queue.extend(self.resync())  # no await in between: exactly the state as of now
                self.num_resyncs += 1
                log.info("outbox resync queued", num_messages=len(self._queue))
            if not self._queue:
                continue
            envelope = self._queue[0]
            try:
                await self._send(envelope)
            except Exception as exc:  # NATS away or not acking: the same message again, later
                self.num_retries += 1
                if self.num_retries % 20 == 1:
                    log.warning("outbox send failed; retrying", subject=envelope.subject, error=repr(exc))
                await asyncio.sleep(self.retry_s)
                continue
            if self._queue and self._queue[0] is envelope:  # not dropped by an overflow meanwhile
                self._queue.popleft()
            self.num_sent += 1

    async def _send(self, envelope: Envelope) -> None:
        headers = {**(envelope.headers or {}), MSG_ID: envelope.msg_id}
        if self.jetstream and await self._stream_exists():
            await self.bus.client.jetstream().publish(
                envelope.subject, envelope.payload, timeout=self.ack_timeout_s, headers=headers
            )
        else:
            await self.bus.client.publish(envelope.subject, envelope.payload, headers=headers)
            self.num_unacked += self.jetstream

    async def _stream_exists(self) -> bool:
        """Whether `stream` exists (True without one), asked again after a reconnect (a NATS with a new store may
        have lost it) and every STREAM_RECHECK_S while it is missing. Raises while JetStream does not answer."""
        if self.stream is None:
            return True
        now = time.monotonic()
        checked = self._stream_checked
        is_fresh = checked is not None and checked[1] == self.bus.num_disconnects
        if checked is not None and is_fresh and (checked[2] or now - checked[0] < STREAM_RECHECK_S):
            return checked[2]
        try:
            await self.bus.client.jetstream(timeout=self.ack_timeout_s).stream_info(self.stream)
            exists = True
        except nats.js.errors.NotFoundError:
            exists = False
        except nats.js.errors.ServiceUnavailableError as exc:
            if exc.code is not None:  # JetStream answered, unavailable for now (a cluster electing): ask again
                raise
            exists = False  # nobody answers JetStream's API: this NATS has none
        if checked is None or checked[2] != exists:
            log.info("outbox stream", stream=self.stream, exists=exists)
        self._stream_checked = (now, self.bus.num_disconnects, exists)
        return exists


def export_metrics(name: str, outbox: Outbox) -> None:
    """The outbox's figures on this process's /metrics, labelled `name`, read from it at each scrape."""
    metrics.OUTBOX_MESSAGES.labels(outbox=name).set_function(lambda: len(outbox))
    metrics.OUTBOX_MESSAGES_PEAK.labels(outbox=name).set_function(lambda: outbox.max_len)
    metrics.OUTBOX_MESSAGES_SENT.labels(outbox=name).set_function(lambda: outbox.num_sent)
    metrics.OUTBOX_MESSAGES_DROPPED.labels(outbox=name).set_function(lambda: outbox.num_dropped)
