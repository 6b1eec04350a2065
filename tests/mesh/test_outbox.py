"""The outbox (mesh.outbox): bounded, in order, resent after an outage with the same Nats-Msg-Id (so the stream
keeps one copy), and a resync instead of the queue when it overflows. Over a real NATS that is SIGKILLed and
started again on the same port and store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js.api import StreamConfig

from kvmesh.nats_server import EmbeddedNats
from mesh.bus import Bus
from mesh.outbox import MSG_ID, Envelope, Outbox

STREAM = "OUTBOX_TEST"


def envelope(n: int) -> Envelope:
    return Envelope(f"test.outbox.{n % 2}", str(n).encode(), f"w.1.{n}")


def test_without_a_resync_the_oldest_message_makes_room() -> None:
    outbox = Outbox(None, capacity=3)  # type: ignore[arg-type]  # put and the queue only: no bus needed
    assert [outbox.put(envelope(n)) for n in range(5)] == [True] * 5
    assert ([e.msg_id for e in outbox._queue], outbox.num_dropped) == (["w.1.2", "w.1.3", "w.1.4"], 2)


def test_with_a_resync_an_overflow_drops_the_queue_and_what_follows() -> None:
    outbox = Outbox(None, capacity=3, resync=lambda: [envelope(100)])  # type: ignore[arg-type]
    assert [outbox.put(envelope(n)) for n in range(5)] == [True, True, True, False, False]
    assert (len(outbox), outbox.needs_resync, outbox.num_dropped) == (0, True, 5)


@pytest.fixture
async def nats_and_bus(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedNats, Bus]]:
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        bus = await Bus.connect(nats.url, "test-outbox")
        await bus.client.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["test.outbox.>"]))
        try:
            yield nats, bus
        finally:
            await bus.close()


async def stored(bus: Bus) -> list[tuple[bytes, str]]:
    """The stream's messages in order: (payload, Nats-Msg-Id)."""
    js = bus.client.jetstream()
    info = await js.stream_info(STREAM)
    messages = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        message = await js.get_msg(STREAM, seq)
        messages.append((message.data or b"", (message.headers or {}).get(MSG_ID, "")))
    return messages


async def kill_and_restart(nats: EmbeddedNats, down_s: float, while_down) -> None:
    assert nats.process is not None
    nats.process.kill()  # SIGKILL: nothing is flushed or said goodbye
    nats.process.wait()
    await asyncio.sleep(0.2)
    while_down()
    await asyncio.sleep(down_s)
    nats.start()


async def test_what_is_put_while_nats_is_down_arrives_in_order_once(nats_and_bus) -> None:
    nats, bus = nats_and_bus
    outbox = Outbox(bus, capacity=100, ack_timeout_s=0.5, retry_s=0.05)
    outbox.start()
    for n in range(3):
        outbox.put(envelope(n))
    assert await outbox.flush(5.0)

    await kill_and_restart(nats, 0.5, lambda: [outbox.put(envelope(n)) for n in range(3, 8)])
    assert await outbox.flush(15.0)
    outbox.put(envelope(7))  # sent again (an ack that was lost): the stream drops the copy
    assert await outbox.flush(5.0)
    await outbox.stop()
    assert await stored(bus) == [(str(n).encode(), f"w.1.{n}") for n in range(8)]
    assert (bus.num_disconnects, outbox.num_sent) == (1, 9)


async def test_an_overflow_during_an_outage_sends_the_resync_first(nats_and_bus) -> None:
    nats, bus = nats_and_bus
    outbox = Outbox(bus, capacity=2, resync=lambda: [envelope(100), envelope(101)], ack_timeout_s=0.5, retry_s=0.05)
    outbox.start()

    def overflow() -> None:
        assert [outbox.put(envelope(n)) for n in range(4)] == [True, True, False, False]

    await kill_and_restart(nats, 0.2, overflow)
    assert await outbox.flush(15.0)
    outbox.put(envelope(5))
    assert await outbox.flush(5.0)
    await outbox.stop()
    assert await stored(bus) == [(b"100", "w.1.100"), (b"101", "w.1.101"), (b"5", "w.1.5")]
    assert (outbox.num_resyncs, outbox.num_dropped) == (1, 4)


async def test_until_its_stream_is_made_an_outbox_publishes_plain_then_acknowledged_through_an_outage(
    nats_and_bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode's finished requests: the stream is the gateways' and may not exist yet. Without it a JetStream
    publish gets no ack from the core subscriber (a balancer) and would be sent forever: a plain publish instead,
    with the id; once the stream is made, acknowledged, and what is put while NATS is down arrives once."""
    monkeypatch.setattr("mesh.outbox.STREAM_RECHECK_S", 0.2)
    nats, bus = nats_and_bus
    heard: list[tuple[bytes, str]] = []

    async def on_message(msg) -> None:  # a balancer's core subscription
        heard.append((msg.data, (msg.headers or {}).get(MSG_ID, "")))

    await bus.client.subscribe("test.finished", cb=on_message)
    outbox = Outbox(bus, capacity=100, ack_timeout_s=0.5, retry_s=0.05, stream="FINISHED_TEST")
    outbox.start()
    finished = [Envelope("test.finished", str(n).encode(), f"d.1.{n}") for n in range(6)]
    outbox.put(finished[0])
    assert await outbox.flush(5.0)
    assert (outbox.num_sent, outbox.num_unacked, outbox.num_retries) == (1, 1, 0)

    js = bus.client.jetstream()
    await js.add_stream(StreamConfig(name="FINISHED_TEST", subjects=["test.finished"]))
    await asyncio.sleep(0.3)  # past the recheck: the outbox learns the stream exists
    outbox.put(finished[1])
    assert await outbox.flush(5.0)
    await kill_and_restart(nats, 0.5, lambda: [outbox.put(e) for e in finished[2:5]])
    assert await outbox.flush(15.0)
    outbox.put(finished[4])  # sent again (a lost ack): the stream keeps one
    outbox.put(finished[5])
    assert await outbox.flush(5.0)
    await outbox.stop()
    info = await js.stream_info("FINISHED_TEST")
    kept = [await js.get_msg("FINISHED_TEST", seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    assert [(m.data, (m.headers or {})[MSG_ID]) for m in kept] == [(e.payload, e.msg_id) for e in finished[1:]]
    assert (outbox.num_sent, outbox.num_unacked, outbox.max_len) == (7, 1, 3)
    await asyncio.sleep(0.2)
    assert heard[0] == (b"0", "d.1.0") and heard[-1] == (b"5", "d.1.5")


async def test_an_envelopes_headers_travel_beside_its_message_id(nats_and_bus) -> None:
    """A request's id and trace context go with its event (decode's finished requests), as bus.publish sends them;
    the outbox's own Nats-Msg-Id wins over a header of that name."""
    _, bus = nats_and_bus
    outbox = Outbox(bus, capacity=10)
    outbox.start()
    headers = {"x-request-id": "req-1", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", MSG_ID: "not-this"}
    outbox.put(Envelope("test.outbox.0", b"finished", "w.1.0", headers))
    assert await outbox.flush(5.0)
    await outbox.stop()
    message = await bus.client.jetstream().get_msg(STREAM, 1)
    assert message.data == b"finished"
    assert message.headers == {**headers, MSG_ID: "w.1.0"}
