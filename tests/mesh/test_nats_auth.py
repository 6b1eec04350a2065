"""NATS with users and subject permissions, on a real nats-server: a decode worker cannot speak for the balancer,
another role or another worker (the server refuses, the client's error callback hears it, and a subscriber with
every permission never sees the message); a client without credentials is refused; the gateway's and the
balancer's JetStream work as their own users; registries and KV followers drop what names someone else."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvmesh.nats_server import EmbeddedNats
from mesh import subjects
from mesh.bus import Bus, BusError, redact
from mesh.discovery import WorkerRegistry
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import KVEventFollower, KVIndexCompactor, ensure_kv_stream, publish_acked
from mesh.outbox import MSG_ID, Envelope, Outbox
from mesh.pb import common_pb2, events_pb2

SETTLE_S = 0.3  # a publish refused or delivered on loopback is heard well within this


@pytest.fixture
def server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(workers=[("decode", "decode-0"), ("balancer", "balancer-0")], insecure=False) as running:
        yield running


class Heard:
    """Everything a client with every permission receives, and the errors a restricted client is told."""

    def __init__(self) -> None:
        self.subjects: list[str] = []
        self.errors: list[str] = []

    async def on_message(self, msg: Msg) -> None:
        self.subjects.append(msg.subject)

    async def on_error(self, exc: Exception) -> None:
        self.errors.append(str(exc))


@pytest.fixture
async def heard(server: EmbeddedNats) -> AsyncIterator[Heard]:
    heard = Heard()
    admin = await nats.connect(server.url)
    await admin.subscribe(">", cb=heard.on_message)
    await admin.flush()
    yield heard
    await admin.close()


async def connect(url: str, heard: Heard) -> Client:
    return await nats.connect(url, error_cb=heard.on_error, max_reconnect_attempts=0)


def violation(subject: str) -> str:
    """The error nats-py hands the error callback (it lowercases the server's -ERR line)."""
    return f'nats: permissions violation for publish to "{subject.lower()}"'


async def test_a_decode_worker_publishes_only_its_own_subjects(server: EmbeddedNats, heard: Heard) -> None:
    decode = await connect(server.url_as("decode", "decode-0"), heard)
    allowed = [
        subjects.worker_heartbeat("decode", "decode-0"),
        subjects.kv_events("decode-0"),
        subjects.REQUESTS_FINISHED,
        subjects.expert_load("deepseek-tiny"),
    ]
    refused = [
        subjects.BALANCER_ASSIGN,
        subjects.BALANCER_REPLICAS,
        subjects.worker_heartbeat("balancer", "balancer-0"),
        subjects.worker_heartbeat("decode", "decode-1"),  # another decode worker
        subjects.kv_events("kvcache-0"),
        subjects.expert_plan("deepseek-tiny"),
        subjects.usage("tenant-a"),
        "$JS.API.STREAM.DELETE.KVMESH_KV",
    ]
    for subject in refused + allowed:
        await decode.publish(subject, b"x")
    await decode.flush()
    await asyncio.sleep(SETTLE_S)
    assert heard.subjects == allowed
    assert heard.errors == [violation(subject) for subject in refused]
    await decode.close()


async def test_a_role_user_shared_by_replicas_speaks_for_any_worker_of_its_role_only(
    server: EmbeddedNats, heard: Heard
) -> None:
    decode = await connect(server.url_as("decode"), heard)  # compose: every decode replica holds this one
    await decode.publish(subjects.worker_heartbeat("decode", "decode-7"), b"x")
    await decode.publish(subjects.kv_events("decode.host.example-7"), b"x")  # ids with dots are covered too
    await decode.publish(subjects.worker_heartbeat("prefill", "decode-7"), b"x")
    await decode.flush()
    await asyncio.sleep(SETTLE_S)
    assert heard.subjects == ["kvmesh.workers.decode.decode-7", "kvmesh.kv.decode.host.example-7"]
    assert heard.errors == [violation("kvmesh.workers.prefill.decode-7")]
    await decode.close()


async def test_subscriptions_are_limited_too(server: EmbeddedNats) -> None:
    heard = Heard()
    encoder = await connect(server.url_as("encoder"), heard)
    decode = await connect(server.url_as("decode", "decode-0"), heard)
    await encoder.subscribe(subjects.heartbeat("decode"), cb=heard.on_message)  # the encoder follows nothing
    await decode.subscribe(subjects.ALL_KV_EVENTS, cb=heard.on_message)
    await decode.subscribe(subjects.expert_plan("m"), cb=heard.on_message)  # allowed: it applies plans
    await asyncio.gather(encoder.flush(), decode.flush())
    await asyncio.sleep(SETTLE_S)
    assert sorted(heard.errors) == [
        'nats: permissions violation for subscription to "kvmesh.kv.>"',
        'nats: permissions violation for subscription to "kvmesh.workers.decode.>"',
    ]
    await asyncio.gather(encoder.close(), decode.close())


async def test_a_client_without_the_right_credentials_cannot_connect(server: EmbeddedNats) -> None:
    with pytest.raises(BusError, match="refused this process's credentials"):
        await Bus.connect(server.address, "anonymous", timeout_s=1.0)
    wrong = f"nats://decode:not-the-password@{server.host}:{server.port}"
    with pytest.raises(BusError) as refused:
        await Bus.connect(wrong, "guesser", timeout_s=1.0)
    assert "not-the-password" not in str(refused.value)
    assert f"nats://***@{server.host}:{server.port}" in str(refused.value)


async def test_the_bus_connects_as_the_user_it_is_given(server: EmbeddedNats, heard: Heard) -> None:
    bus = await Bus.connect(server.address, "decode-0", user=server.user("decode", "decode-0"))
    beat = events_pb2.WorkerHeartbeat(worker=common_pb2.WorkerInfo(worker_id="decode-0", role=common_pb2.ROLE_DECODE))
    await bus.publish(subjects.worker_heartbeat("decode", "decode-0"), beat)
    await bus.flush()
    await asyncio.sleep(SETTLE_S)
    assert heard.subjects == ["kvmesh.workers.decode.decode-0"]
    await bus.close()


def test_urls_are_logged_without_their_passwords() -> None:
    assert redact("nats://decode:s3cret@nats:4222") == "nats://***@nats:4222"
    assert redact("tls://u:p@a:1, nats://b:2") == "tls://***@a:1,nats://b:2"
    assert redact("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


async def test_the_gateway_uses_its_jetstream_streams_and_buckets(server: EmbeddedNats) -> None:
    from services.gateway.response_store import ResponseStore
    from services.gateway.tenancy.abandoned import ensure_finished_stream
    from services.gateway.tenancy.ledger import ensure_usage_stream

    gateway = await nats.connect(server.url_as("gateway"))
    js = gateway.jetstream(timeout=2)
    await ensure_usage_stream(js)
    await ensure_finished_stream(js)
    ack = await js.publish(subjects.usage("tenant-a"), b"usage", timeout=2)
    assert ack.stream == "KVMESH_USAGE" and ack.seq == 1
    pulled = await js.pull_subscribe(subjects.ALL_USAGE, durable="test", stream="KVMESH_USAGE")
    (message,) = await pulled.fetch(1, timeout=2)
    assert (message.subject, message.data) == ("kvmesh.usage.tenant-a", b"usage")
    await message.ack()
    store = ResponseStore(gateway)
    assert await store.put("resp_1", {"output": "hi"}, tenant_id="tenant-a")
    assert await store.get("resp_1", tenant_id="tenant-a") == {"output": "hi", "tenant_id": "tenant-a"}
    limits = await js.create_key_value(bucket="KVMESH_LIMITS")
    await limits.put("tenant-a", b"3")
    assert (await limits.get("tenant-a")).value == b"3"
    watcher = await limits.watchall()  # an ordered consumer on the bucket's stream, as the limiter follows it
    seen = await watcher.updates(timeout=2)
    assert seen is not None and (seen.key, seen.value) == ("tenant-a", b"3")
    await watcher.stop()
    await gateway.close()


async def test_jetstream_is_refused_to_the_roles_that_do_not_use_it(server: EmbeddedNats) -> None:
    heard = Heard()
    encoder = await connect(server.url_as("encoder"), heard)
    with pytest.raises(nats.errors.Error):  # the API request is refused, so no answer comes
        await encoder.jetstream(timeout=0.5).stream_info("KVMESH_USAGE")
    inbox, request = heard.errors  # nor may it subscribe to the inbox an answer would come to
    assert inbox.startswith('nats: permissions violation for subscription to "_inbox.')
    assert request == violation("$JS.API.STREAM.INFO.KVMESH_USAGE")
    await encoder.close()


async def test_decode_publishes_its_finished_requests_acknowledged_and_nothing_else_of_jetstream(
    server: EmbeddedNats,
) -> None:
    """Its outbox (mesh.outbox) asks whether the gateways' KVMESH_FINISHED exists and gets the stream's acks;
    the stream's messages and any other stream stay closed to it."""
    from services.gateway.tenancy.abandoned import ensure_finished_stream
    from services.gateway.tenancy.ledger import ensure_usage_stream

    gateway = await nats.connect(server.url_as("gateway"))
    await ensure_finished_stream(gateway.jetstream(timeout=2))
    await ensure_usage_stream(gateway.jetstream(timeout=2))
    heard = Heard()
    decode = await connect(server.url_as("decode", "decode-0"), heard)
    outbox = Outbox(Bus(decode), capacity=10, ack_timeout_s=1.0, stream=subjects.FINISHED_STREAM)
    outbox.start()
    outbox.put(Envelope(subjects.REQUESTS_FINISHED, b"finished", "decode-0.1.1"))
    assert await outbox.flush(5.0)
    await outbox.stop()
    assert (outbox.num_sent, outbox.num_unacked, outbox.num_retries) == (1, 0, 0)
    kept = await gateway.jetstream(timeout=2).get_msg(subjects.FINISHED_STREAM, 1)
    assert (kept.data, (kept.headers or {})[MSG_ID]) == (b"finished", "decode-0.1.1")
    for refused in (
        decode.jetstream(timeout=0.5).get_msg(subjects.FINISHED_STREAM, 1),
        decode.jetstream(timeout=0.5).stream_info("KVMESH_USAGE"),
    ):
        with pytest.raises(nats.errors.Error):
            await refused
    await asyncio.sleep(SETTLE_S)
    assert heard.errors == [
        violation(f"$JS.API.STREAM.MSG.GET.{subjects.FINISHED_STREAM}"),
        violation("$JS.API.STREAM.INFO.KVMESH_USAGE"),
    ]
    await asyncio.gather(decode.close(), gateway.close())


async def test_a_role_reaches_only_its_own_streams(server: EmbeddedNats) -> None:
    from services.gateway.tenancy.ledger import ensure_usage_stream

    gateway = await nats.connect(server.url_as("gateway"))
    await ensure_usage_stream(gateway.jetstream(timeout=2))
    kvcache = await nats.connect(server.url_as("kvcache"))
    assert await ensure_kv_stream(Bus(kvcache))  # made by its owner, a store node
    heard = Heard()
    prefill = await connect(server.url_as("prefill", "prefill-0"), heard)
    assert await ensure_kv_stream(Bus(prefill), create=False)  # the KV index's stream: its own to read
    with pytest.raises(nats.errors.Error):  # the gateway's usage (billing) stream: not even its info
        await prefill.jetstream(timeout=0.5).stream_info("KVMESH_USAGE")
    with pytest.raises(nats.errors.Error):
        await prefill.jetstream(timeout=0.5).delete_stream("KVMESH_USAGE")
    assert heard.errors == [
        violation("$JS.API.STREAM.INFO.KVMESH_USAGE"),
        violation("$JS.API.STREAM.DELETE.KVMESH_USAGE"),
    ]
    assert (await gateway.jetstream(timeout=2).stream_info("KVMESH_USAGE")).config.name == "KVMESH_USAGE"
    await asyncio.gather(gateway.close(), prefill.close(), kvcache.close())


async def test_within_its_streams_a_role_may_do_only_what_it_does(server: EmbeddedNats) -> None:
    """Prefill and store nodes read KVMESH_KV and its snapshots, but only the balancer purges them (compaction);
    nobody deletes or reconfigures a stream, the gateway not even its own usage stream, nor acks another's."""
    from services.gateway.tenancy.ledger import ensure_usage_stream

    gateway_heard = Heard()
    gateway = await connect(server.url_as("gateway"), gateway_heard)
    kvcache = await nats.connect(server.url_as("kvcache"))
    await ensure_usage_stream(gateway.jetstream(timeout=2))
    assert await ensure_kv_stream(Bus(kvcache))
    block = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[b"\x01" * 32]))
    await publish_acked(Bus(kvcache), events_pb2.KVEventBatch(worker_id="kvcache-0", seq=1, events=[block]))
    heard = Heard()
    prefill = await connect(server.url_as("prefill", "prefill-0"), heard)
    assert (await prefill.jetstream(timeout=2).stream_info("KVMESH_KV")).state.messages == 1  # its own to read
    usage = await gateway.jetstream(timeout=2).stream_info("KVMESH_USAGE")
    refused = [
        prefill.jetstream(timeout=0.5).purge_stream("KVMESH_KV"),
        prefill.jetstream(timeout=0.5).delete_stream("KVMESH_KV"),
        prefill.jetstream(timeout=0.5).delete_msg("KVMESH_KV", 1),
        prefill.jetstream(timeout=0.5).update_stream(usage.config),
        gateway.jetstream(timeout=0.5).purge_stream("KVMESH_USAGE"),
        gateway.jetstream(timeout=0.5).delete_stream("KVMESH_USAGE"),
    ]
    for call in refused:
        with pytest.raises(nats.errors.Error):  # the request is dropped, so no answer comes
            await call
    await prefill.publish("$JS.ACK.KVMESH_USAGE.ledger.1.1.1.0.0", b"+ACK")  # a usage message acked by prefill
    await prefill.flush()
    for _ in range(40):  # the client reports the server's -ERR from a task of its own: it may come after the PONG
        if len(heard.errors) >= 5:
            break
        await asyncio.sleep(0.05)
    assert heard.errors == [
        violation("$JS.API.STREAM.PURGE.KVMESH_KV"),
        violation("$JS.API.STREAM.DELETE.KVMESH_KV"),
        violation("$JS.API.STREAM.MSG.DELETE.KVMESH_KV"),
        violation("$JS.API.STREAM.UPDATE.KVMESH_USAGE"),
        violation("$JS.ACK.KVMESH_USAGE.ledger.1.1.1.0.0"),
    ]
    assert gateway_heard.errors == [
        violation("$JS.API.STREAM.PURGE.KVMESH_USAGE"),
        violation("$JS.API.STREAM.DELETE.KVMESH_USAGE"),
    ]
    balancer = await nats.connect(server.url_as("balancer", "balancer-0"))
    assert (await balancer.jetstream(timeout=2).stream_info("KVMESH_KV")).state.messages == 1  # nothing was purged
    assert await balancer.jetstream(timeout=2).purge_stream("KVMESH_KV")  # compaction: the balancer's to do
    assert (await balancer.jetstream(timeout=2).stream_info("KVMESH_KV")).state.messages == 0
    await asyncio.gather(*(c.close() for c in (gateway, kvcache, prefill, balancer)))


async def test_only_the_owners_create_the_kv_index_streams(server: EmbeddedNats) -> None:
    """Prefill reads KVMESH_KV and its snapshots but may not create them (it could make them first with a short
    max_age or other subjects): its follower waits until a store node has made the stream, then follows it. A
    store node makes the stream but not the balancer's snapshot stores."""
    heard = Heard()
    prefill = await connect(server.url_as("prefill", "prefill-0"), heard)
    assert not await ensure_kv_stream(Bus(prefill), create=True)  # refused: the server never answers
    assert not await ensure_kv_stream(Bus(prefill), create=False)
    follower = KVEventFollower(Bus(prefill), GlobalKVIndex(), frozenset({"host", "ssd"}), create=False)
    starting = asyncio.create_task(follower.start_eventually(retry_s=0.1))
    await asyncio.sleep(0.5)
    assert not starting.done()
    kvcache_heard = Heard()
    kvcache = await connect(server.url_as("kvcache"), kvcache_heard)
    assert await ensure_kv_stream(Bus(kvcache))  # the store node owns it
    block = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[b"\x07" * 32]))
    await publish_acked(
        Bus(kvcache), events_pb2.KVEventBatch(worker_id="kvcache-0", seq=1, tier="host", events=[block])
    )
    await asyncio.wait_for(starting, 10)
    assert await follower.wait_caught_up(5)
    # the follower may have started between the stream's creation and the publish (caught up to an empty
    # stream, as it should be): then it applies the batch as it follows, a moment later
    for _ in range(100):
        if follower.index.num_blocks("kvcache-0") == 1:
            break
        await asyncio.sleep(0.05)
    assert follower.index.num_blocks("kvcache-0") == 1
    with pytest.raises(nats.errors.Error):
        await kvcache.jetstream(timeout=0.5).create_key_value(bucket="KVMESH_KV_SNAPSHOT")
    await asyncio.sleep(SETTLE_S)
    assert heard.errors[0] == violation("$JS.API.STREAM.CREATE.KVMESH_KV")
    assert set(heard.errors) == {violation("$JS.API.STREAM.CREATE.KVMESH_KV")}
    assert kvcache_heard.errors == [violation("$JS.API.STREAM.CREATE.KV_KVMESH_KV_SNAPSHOT")]
    await follower.stop()
    await asyncio.gather(prefill.close(), kvcache.close())


def heartbeat(worker_id: str, role: Any, leaving: bool = False) -> events_pb2.WorkerHeartbeat:
    info = common_pb2.WorkerInfo(worker_id=worker_id, role=role, address="127.0.0.1:1")
    return events_pb2.WorkerHeartbeat(worker=info, leaving=leaving)


async def test_a_registry_hears_a_heartbeat_only_from_the_worker_it_names(server: EmbeddedNats) -> None:
    admin = await Bus.connect(server.url, "admin")  # every permission: what a role could forge is the registry's
    registry = WorkerRegistry(admin, [common_pb2.ROLE_DECODE, common_pb2.ROLE_BALANCER], interval_s=60)
    await registry.start()
    decode_subject = subjects.worker_heartbeat("decode", "decode-0")
    await admin.publish(decode_subject, heartbeat("decode-0", common_pb2.ROLE_DECODE))
    await admin.publish(decode_subject, heartbeat("balancer-9", common_pb2.ROLE_BALANCER))  # a decode as balancer
    await admin.publish(decode_subject, heartbeat("decode-1", common_pb2.ROLE_DECODE))  # another decode worker
    await admin.publish(decode_subject, heartbeat("decode-0", common_pb2.ROLE_BALANCER))  # its own id, wrong role
    await admin.flush()
    await asyncio.sleep(SETTLE_S)
    assert [w.worker_id for w in registry.workers()] == ["decode-0"]
    assert registry.num_forged == 3
    # a "leaving" for decode-0 sent on another worker's subject does not remove it; its own does
    await admin.publish(
        subjects.worker_heartbeat("decode", "decode-1"), heartbeat("decode-0", common_pb2.ROLE_DECODE, leaving=True)
    )
    await admin.flush()
    await asyncio.sleep(SETTLE_S)
    assert [w.worker_id for w in registry.workers()] == ["decode-0"] and registry.num_forged == 4
    await admin.publish(decode_subject, heartbeat("decode-0", common_pb2.ROLE_DECODE, leaving=True))
    await admin.flush()
    await asyncio.sleep(SETTLE_S)
    assert registry.workers() == []
    await registry.stop()
    await admin.close()


def test_a_kv_event_batch_is_about_the_worker_of_its_subject() -> None:
    assert subjects.kv_events_worker("kvmesh.kv.decode-0", "decode-0") == "decode-0"
    assert subjects.kv_events_worker("kvmesh.kv.decode-0", "") == "decode-0"
    assert subjects.kv_events_worker("kvmesh.kv.decode-0", "kvcache-1") is None
    assert subjects.kv_events_worker("kvmesh.kv.a.b", "a.b") == "a.b"


async def test_the_kv_index_drops_batches_that_name_another_worker(server: EmbeddedNats) -> None:
    admin = await Bus.connect(server.url, "admin")
    balancer = await Bus.connect(server.url_as("balancer", "balancer-0"), "balancer-0")
    assert await ensure_kv_stream(balancer)
    block = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[b"\x01" * 32]))
    forged = events_pb2.KVEventBatch(worker_id="kvcache-0", seq=1, tier="host", events=[block])
    await admin.client.jetstream().publish(subjects.kv_events("decode-0"), forged.SerializeToString())
    await publish_acked(admin, events_pb2.KVEventBatch(worker_id="decode-0", seq=1, tier="device", events=[block]))
    index = GlobalKVIndex()
    follower = KVEventFollower(balancer, index)
    await follower.start()
    assert await follower.wait_caught_up(5)
    assert (index.num_blocks("decode-0"), index.num_blocks("kvcache-0"), follower.num_forged) == (1, 0, 1)
    await follower.stop()
    await asyncio.gather(balancer.close(), admin.close())


async def test_the_balancer_compacts_and_the_stores_restore_as_their_own_users(server: EmbeddedNats) -> None:
    urls = {role: server.url_as(role) for role in ("balancer", "prefill", "kvcache")}
    buses = {role: await Bus.connect(url, role) for role, url in urls.items()}
    kvcache = buses["kvcache"]
    assert await ensure_kv_stream(kvcache)
    for seq in range(1, 5):  # a store node's own acknowledged publishes
        block = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[bytes([seq]) * 32]))
        await publish_acked(
            kvcache, events_pb2.KVEventBatch(worker_id="kvcache-0", seq=seq, tier="host", events=[block])
        )
    follower = KVEventFollower(buses["balancer"], GlobalKVIndex())
    await follower.start()
    assert await follower.wait_caught_up(5)
    assert await KVIndexCompactor(follower, every=4).compact()  # a snapshot in the balancer's KV and object store
    restored = [
        KVEventFollower(buses[role], GlobalKVIndex(), frozenset({"host", "ssd"})) for role in ("prefill", "kvcache")
    ]
    for late in restored:
        await late.start()
        assert await late.wait_caught_up(5)
        assert (late.num_restores, late.index.num_blocks("kvcache-0")) == (1, 4)
    for each in (follower, *restored):
        await each.stop()
    await asyncio.gather(*(bus.close() for bus in buses.values()))


async def test_a_server_restarted_on_its_store_keeps_its_users(tmp_path) -> None:
    first = EmbeddedNats(store_dir=tmp_path, insecure=False).start()
    url, port = first.url, first.port
    first.stop()
    second = EmbeddedNats(port=port, store_dir=tmp_path, insecure=False).start()
    try:
        assert second.url == url
        client = await nats.connect(url)
        await client.close()
    finally:
        second.stop()
    assert (tmp_path / "kvmesh-users.json").stat().st_mode & 0o777 == 0o600


async def test_insecure_is_an_open_server(tmp_path) -> None:
    with EmbeddedNats(insecure=True) as server:
        assert server.url == server.address
        client = await nats.connect(server.address)
        await client.publish(subjects.BALANCER_ASSIGN, b"x")
        await client.flush()
        await client.close()
