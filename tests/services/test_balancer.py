"""The balancer service on a real NATS (with JetStream): workers made present by real Announcers, caches by real KV
event batches replayed through the KVMESH_KV stream into the global index, routing by the policy
KVMESH_BALANCER_POLICY names, decisions shared between two replicas, and recommended pool sizes. The policies
themselves are tested with exact values in tests/mesh/test_routing_policies.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY

from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import kv_snapshot, metrics, subjects
from mesh.bus import Bus
from mesh.config import SettingError, load_settings
from mesh.discovery import Announcer, KnownWorker
from mesh.kv_stream import ensure_kv_stream
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2, events_pb2
from mesh.routing import Assignment
from mesh.routing.encoder import rendezvous_rank
from services.balancer.config import BalancerSettings
from services.balancer.server import assignment_from_pb, assignment_to_pb, serve, worker_state
from tests.services.harness import serving, wait_until

BLOCK_SIZE = 16
INTERVAL_S = 0.2


def key(i: int) -> bytes:
    return bytes([i]) * 32


# -- settings and conversions ---------------------------------------------------------------------------------------


def test_a_bad_policy_fails_at_start_naming_the_setting() -> None:
    assert load_settings(BalancerSettings, env={}).balancer_policy == "kvmesh"
    assert load_settings(BalancerSettings, env={"KVMESH_BALANCER_POLICY": "kv_aware"}).balancer_policy == "kv_aware"
    with pytest.raises(SettingError, match=r"^KVMESH_BALANCER_POLICY='fastest': must be one of round_robin, "):
        load_settings(BalancerSettings, env={"KVMESH_BALANCER_POLICY": "fastest"})
    assert load_settings(BalancerSettings, env={}).balancer_decode_binding == "late"
    with pytest.raises(SettingError, match=r"^KVMESH_BALANCER_DECODE_BINDING='lazy': must be one of early, late"):
        load_settings(BalancerSettings, env={"KVMESH_BALANCER_DECODE_BINDING": "lazy"})
    with pytest.raises(SettingError, match="KVMESH_BALANCER_TARGET_UTILIZATION"):
        load_settings(BalancerSettings, env={"KVMESH_BALANCER_TARGET_UTILIZATION": "1.5"})
    with pytest.raises(SettingError, match=r"^KVMESH_KV_SNAPSHOT_EVERY=-1: must be 0 \(never\) or more"):
        load_settings(BalancerSettings, env={"KVMESH_KV_SNAPSHOT_EVERY": "-1"})


def test_conversions() -> None:
    info = common_pb2.WorkerInfo(
        worker_id="p-1", role=common_pb2.ROLE_PREFILL, block_size=16, max_num_seqs=8, num_kv_blocks=100
    )
    load = common_pb2.WorkerLoad(
        num_running=1, num_waiting=2, num_queued_prompt_tokens=300, num_kv_tokens=40, num_cached_blocks=7
    )
    state = worker_state(KnownWorker(info, load, last_seen_ms=1500))
    assert (state.reported_s, state.num_kv_capacity_tokens, state.num_waiting, state.num_cached_blocks) == (
        1.5,
        1600,
        2,
        7,
    )
    assignment = Assignment("b-1", "r-1", 10.5, "p-1", "d-1", 48, 16, 0.25, 11.0, (key(1), key(2), key(3)))
    message = assignment_to_pb(assignment, num_cached_blocks=2)  # peers need only the blocks it will newly hold
    assert list(message.block_hashes) == [key(3)]
    assert assignment_from_pb(message) == Assignment("b-1", "r-1", 10.5, "p-1", "d-1", 48, 16, 0.25, 11.0, (key(3),))


# -- the service ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats")) as nats:
        yield nats.url


def settings(
    nats_url: str, worker_id: str, policy: str = "kvmesh", interval_s: float = INTERVAL_S, decode_binding: str = "early"
) -> BalancerSettings:
    """Early binding unless asked: these tests read the Route's pair (test_balancer_late_binding.py the other)."""
    return BalancerSettings(
        nats_url=nats_url,
        grpc_port=free_port(),
        http_port=free_port(),
        worker_id=worker_id,
        heartbeat_interval_s=interval_s,
        health_check_interval_s=0,  # the workers here are heartbeats alone, with no gRPC server to check
        balancer_policy=policy,
        balancer_decode_binding=decode_binding,
    )


async def start_worker(
    nats_url: str, worker_id: str, role: int, interval_s: float = INTERVAL_S, **load: int
) -> Announcer:
    """A worker's presence: its own NATS connection beating every interval, exactly as a worker's runtime does."""
    bus = await Bus.connect(nats_url, name=worker_id)
    address = f"127.0.0.1:{7000 + int(worker_id[-1])}"
    info = common_pb2.WorkerInfo(
        worker_id=worker_id,
        role=role,
        address=address,  # type: ignore[arg-type]
        models=["m"],
        max_num_seqs=8,
        num_kv_blocks=100,
        block_size=BLOCK_SIZE,
    )
    announcer = Announcer(bus, info, lambda: common_pb2.WorkerLoad(**load), interval_s)
    await announcer.start()
    return announcer


async def stop_workers(workers: dict[str, Announcer]) -> None:
    for announcer in workers.values():
        await announcer.stop()
        await announcer.bus.close()


def route_request(
    *block_ids: int, num_prompt_tokens: int = 48, model: str = "m", request_id: str = "r", exclude: tuple[str, ...] = ()
) -> balancer_pb2.RouteRequest:
    return balancer_pb2.RouteRequest(
        request_id=request_id,
        model=model,
        block_hashes=[key(i) for i in block_ids],
        num_prompt_tokens=num_prompt_tokens,
        exclude_worker_ids=exclude,
    )


def picked(response: balancer_pb2.RouteResponse) -> tuple[str, str, int]:
    return response.prefill.worker_id, response.decode.worker_id, response.num_cached_tokens


async def listed(stub: balancer_pb2_grpc.BalancerStub) -> balancer_pb2.ListWorkersResponse:
    return await stub.ListWorkers(balancer_pb2.ListWorkersRequest())


async def listed_ids(stub: balancer_pb2_grpc.BalancerStub) -> set[str]:
    return {status.worker.worker_id for status in (await listed(stub)).workers}


async def stored_batch(bus: Bus, worker_id: str, seq: int, *block_ids: int) -> None:
    event = events_pb2.KVEvent(
        stored=events_pb2.KVBlocksStored(
            block_hashes=[key(i) for i in block_ids], parent_hash=b"\0" * 32, block_size=BLOCK_SIZE, model="m"
        )
    )
    await bus.publish(
        subjects.kv_events(worker_id),
        events_pb2.KVEventBatch(worker_id=worker_id, seq=seq, tier="device", events=[event]),
    )


async def index_size(num_blocks: int) -> bool:
    return REGISTRY.get_sample_value("kvmesh_kv_index_blocks") == num_blocks


async def expect_unavailable(stub: balancer_pb2_grpc.BalancerStub, request: balancer_pb2.RouteRequest) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Route(request)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    return str(error.value.details())


async def test_the_balancer_compacts_the_kv_stream_and_a_restarted_one_restores_the_snapshot(tmp_path) -> None:
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:  # its own stream: this test purges it
        workers = {
            "p-1": await start_worker(nats.url, "p-1", common_pb2.ROLE_PREFILL),
            "d-1": await start_worker(nats.url, "d-1", common_pb2.ROLE_DECODE),
        }
        worker = workers["p-1"]
        assert await ensure_kv_stream(worker.bus)
        js = worker.bus.client.jetstream()
        compacting = replace(settings(nats.url, "balancer-a"), kv_snapshot_every=4, kv_snapshot_check_s=0.05)

        async def all_listed() -> bool:
            return await listed_ids(stub) == set(workers)

        async def snapshot_at(seq: int) -> bool:
            info = await js.stream_info("KVMESH_KV")
            return await kv_snapshot.latest_seq(worker.bus) == seq and info.state.first_seq == seq + 1

        async with serving(serve, compacting) as channel:
            stub = balancer_pb2_grpc.BalancerStub(channel)
            for seq in range(1, 7):  # one block per batch: p-1 ends up holding blocks 1-6
                event = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[key(seq)]))
                batch = events_pb2.KVEventBatch(worker_id="p-1", seq=seq, tier="device", events=[event])
                await js.publish(subjects.kv_events("p-1"), batch.SerializeToString())
            await wait_until(lambda: snapshot_at(6))  # 6 messages applied, >= 4 since none: one snapshot
        async with serving(serve, compacting) as channel:  # restarted: the stream holds nothing before seq 7
            stub = balancer_pb2_grpc.BalancerStub(channel)
            await wait_until(all_listed)
            response = await stub.Route(route_request(1, 2, 3, 4, 5, 6, 7, num_prompt_tokens=7 * BLOCK_SIZE))
            assert picked(response)[::2] == ("p-1", 6 * BLOCK_SIZE)
        await stop_workers(workers)


async def test_service_routes_by_the_policy_over_heartbeats_and_the_kv_event_stream(nats_url: str) -> None:
    routes_before = REGISTRY.get_sample_value("kvmesh_balancer_routes_total", {"pool": "prefill", "worker": "p-2"})
    workers = {
        "p-1": await start_worker(nats_url, "p-1", common_pb2.ROLE_PREFILL),
        "p-2": await start_worker(nats_url, "p-2", common_pb2.ROLE_PREFILL),
    }
    assert await ensure_kv_stream(workers["p-2"].bus)  # as every role that publishes KV events does
    await stored_batch(workers["p-2"].bus, "p-2", 1, 1, 2)  # before the balancer starts: it replays the stream
    metrics.KV_INDEX_BLOCKS.set(-1)  # the index's follower sets it to the index's size at every batch
    async with serving(serve, settings(nats_url, "balancer-a")) as channel:
        stub = balancer_pb2_grpc.BalancerStub(channel)
        await wait_until(lambda: index_size(2))
        workers["d-1"] = await start_worker(nats_url, "d-1", common_pb2.ROLE_DECODE, num_running=3)
        workers["d-2"] = await start_worker(nats_url, "d-2", common_pb2.ROLE_DECODE, num_running=1)

        async def all_listed() -> bool:
            return await listed_ids(stub) == set(workers)

        await wait_until(all_listed)
        status = next(s for s in (await listed(stub)).workers if s.worker.worker_id == "d-1")
        assert (status.load.num_running, status.worker.address, status.last_seen_ms > 0) == (3, "127.0.0.1:7001", True)
        assert REGISTRY.get_sample_value("kvmesh_balancer_workers", {"pool": "prefill"}) == 2

        # kvmesh: p-2 holds 32 of the 48 tokens (the index replayed them); decode: equal KV, d-2 runs fewer requests
        response = await stub.Route(route_request(1, 2, 3))
        assert picked(response) == ("p-2", "d-2", 32)
        assert response.prefill.address == "127.0.0.1:7002" and response.predicted_ttft_s > 0
        assert picked(await stub.Route(route_request(1, 2, 3, exclude=("p-2",))))[::2] == ("p-1", 0)
        assert await expect_unavailable(stub, route_request(model="other")) == "no prefill worker serves model 'other'"
        routes_after = REGISTRY.get_sample_value("kvmesh_balancer_routes_total", {"pool": "prefill", "worker": "p-2"})
        assert (routes_after or 0) - (routes_before or 0) == 1

        await stored_batch(workers["p-1"].bus, "p-1", 1, 7, 8, 9)  # live events follow the replay
        await wait_until(lambda: index_size(5))
        assert picked(await stub.Route(route_request(7, 8, 9, 10, num_prompt_tokens=64)))[::2] == ("p-1", 48)

        await workers["p-1"].stop()  # graceful: a `leaving` heartbeat

        async def p1_gone() -> bool:
            return "p-1" not in await listed_ids(stub)

        await wait_until(p1_gone, timeout_s=2)
        assert (
            await expect_unavailable(stub, route_request(exclude=("p-2",)))
            == "no prefill worker serves model 'm' (1 excluded)"
        )

        await workers["d-2"].bus.client.close()  # a crash: its heartbeats stop, no `leaving`
        crashed = time.monotonic()

        async def d2_gone() -> bool:
            return "d-2" not in await listed_ids(stub)

        await wait_until(d2_gone, timeout_s=3)
        assert 1.5 * INTERVAL_S <= time.monotonic() - crashed <= 3 * INTERVAL_S + 1.0  # three missed intervals
        assert picked(await stub.Route(route_request(1, 2, 3)))[:2] == ("p-2", "d-1")
        del workers["d-2"]
        await stop_workers(workers)


async def test_a_request_heard_leaving_decode_frees_its_kv_before_the_next_heartbeat(nats_url: str) -> None:
    interval_s = 3.0  # no second heartbeat during the test: what changes the pick is the feed alone
    heard_before = REGISTRY.get_sample_value("kvmesh_balancer_finished_requests_total") or 0.0
    workers = {
        "p-1": await start_worker(nats_url, "p-1", common_pb2.ROLE_PREFILL, interval_s),
        "d-1": await start_worker(
            nats_url, "d-1", common_pb2.ROLE_DECODE, interval_s, num_running=2, num_kv_tokens=1000
        ),
        "d-2": await start_worker(
            nats_url, "d-2", common_pb2.ROLE_DECODE, interval_s, num_running=1, num_kv_tokens=600
        ),
    }
    async with serving(serve, settings(nats_url, "balancer-f", interval_s=interval_s)) as channel:
        stub = balancer_pb2_grpc.BalancerStub(channel)

        async def all_listed() -> bool:
            return await listed_ids(stub) == set(workers)

        await wait_until(all_listed)
        assert picked(await stub.Route(route_request(1, request_id="r-1")))[1] == "d-2"  # 600 tokens against 1,000
        await workers["d-1"].bus.publish(
            subjects.REQUESTS_FINISHED,
            events_pb2.RequestFinished(
                request_id="gone",
                worker_id="d-1",
                model="m",
                num_kv_tokens=700,
                num_output_tokens=120,
                finish_reason="stop",
                timestamp_ms=int(time.time() * 1000),
            ),
        )

        async def heard() -> bool:
            return REGISTRY.get_sample_value("kvmesh_balancer_finished_requests_total") == heard_before + 1

        await wait_until(heard)
        # d-1 now holds 300 (one request left), d-2 600 + r-1's 48 on their way
        assert picked(await stub.Route(route_request(1, request_id="r-2")))[1] == "d-1"
    await stop_workers(workers)


async def test_replicas_share_decisions_and_recommend_pool_sizes(nats_url: str) -> None:
    interval_s = 2.0  # reports slower than the test: only shared decisions can tell the second replica
    workers = {
        name: await start_worker(nats_url, name, role, interval_s, **load)
        for name, role, load in (
            ("p-5", common_pb2.ROLE_PREFILL, {"num_running": 1}),
            ("p-6", common_pb2.ROLE_PREFILL, {}),
            ("d-5", common_pb2.ROLE_DECODE, {}),
        )
    }
    replicas = await Bus.connect(nats_url, name="listener")
    recommendations: asyncio.Queue[balancer_pb2.ReplicaRecommendation] = asyncio.Queue()

    async def on_recommendation(message: balancer_pb2.ReplicaRecommendation, subject: str) -> None:
        if message.balancer_id == "balancer-c":
            await recommendations.put(message)

    subscription = await replicas.subscribe(
        subjects.BALANCER_REPLICAS, balancer_pb2.ReplicaRecommendation, on_recommendation
    )
    one, two = (
        settings(nats_url, "balancer-b", "least_load", interval_s),
        settings(nats_url, "balancer-c", "least_load", interval_s),
    )
    async with serving(serve, one) as first_channel, serving(serve, two) as second_channel:
        first, second = balancer_pb2_grpc.BalancerStub(first_channel), balancer_pb2_grpc.BalancerStub(second_channel)
        for stub in (first, second):
            await wait_until(lambda stub=stub: _lists(stub, set(workers)), timeout_s=5)
        big = route_request(num_prompt_tokens=5000, request_id="big")
        # read before routing: the peer may hear the decision before Route's answer gets back here
        peers_before = REGISTRY.get_sample_value("kvmesh_balancer_peer_assignments_total") or 0
        assert picked(await first.Route(big))[0] == "p-5"  # equal queues: the worker id

        async def heard() -> bool:
            return (REGISTRY.get_sample_value("kvmesh_balancer_peer_assignments_total") or 0) > peers_before

        await wait_until(heard, timeout_s=5)
        assert picked(await second.Route(route_request(num_prompt_tokens=10, request_id="small")))[0] == "p-6"

        recommendation = await asyncio.wait_for(recommendations.get(), timeout=3 * interval_s)
        pools = {p.pool: p for p in recommendation.pools}
        # p-5 reports a running request, p-6 nothing: half the prefill pool busy -> ceil(2 x 0.5 / 0.8) = 2
        assert (pools["prefill"].num_workers, pools["prefill"].utilization, pools["prefill"].num_recommended) == (
            2,
            0.5,
            2,
        )
        assert (pools["decode"].num_workers, pools["decode"].num_recommended) == (1, 1)
        listed_pools = {p.pool: p.num_recommended for p in (await listed(second)).pools}
        # no encoder here: an empty pool is recommended 1 (its autoscaler keeps its minimum)
        assert listed_pools == {"prefill": 2, "decode": 1, "encoder": 1}
    await subscription.unsubscribe()
    await replicas.close()
    await stop_workers(workers)


async def test_decode_kv_in_use_is_the_share_of_blocks_held_whatever_a_models_block_size(nats_url: str) -> None:
    """A V4-Flash decode worker's blocks are 128 tokens beside its block_size of 16: 3,840 tokens hold 30 of its 80
    blocks (0.375), where 80 x 16 tokens would read as 3 times full. A worker serving V4-Flash beside a model of 16
    reports one block count for both engines: its share of blocks held is all it can say."""
    loads = {
        "d-3": ({"v4": 128}, common_pb2.WorkerLoad(num_running=1, num_kv_tokens=3840, kv_usage=0.375)),
        "d-4": ({"v4": 128, "m": 16}, common_pb2.WorkerLoad(num_running=3, num_kv_tokens=2000, kv_usage=0.375)),
    }
    workers = {}
    for worker_id, (block_sizes, load) in loads.items():
        info = common_pb2.WorkerInfo(
            worker_id=worker_id,
            role=common_pb2.ROLE_DECODE,
            address=f"127.0.0.1:{7000 + int(worker_id[-1])}",
            models=list(block_sizes),
            max_num_seqs=8,
            num_kv_blocks=80,
            block_size=BLOCK_SIZE,
            model_block_sizes=block_sizes,
        )
        workers[worker_id] = Announcer(await Bus.connect(nats_url, name=worker_id), info, lambda load=load: load, 0.2)
        await workers[worker_id].start()
    async with serving(serve, settings(nats_url, "balancer-k")) as channel:
        stub = balancer_pb2_grpc.BalancerStub(channel)
        decode: list[balancer_pb2.PoolStatus] = []

        async def both_planned() -> bool:
            pools = (await listed(stub)).pools  # both heard and observed (a pool not yet observed reads 0)
            decode[:] = [p for p in pools if p.pool == "decode" and p.num_workers == 2 and p.utilization > 0]
            return bool(decode)

        await wait_until(both_planned, timeout_s=5)
    await stop_workers(workers)
    # each: max(0.375 of blocks held, d-3 1/8 and d-4 3/8 of batch slots); ceil(2 x 0.375 / 0.8) = 1
    assert (decode[0].utilization, decode[0].num_recommended) == (0.375, 1)


async def _lists(stub: balancer_pb2_grpc.BalancerStub, names: set[str]) -> bool:
    return await listed_ids(stub) == names


async def test_route_encoder_sends_an_image_home_and_around_excluded_workers(nats_url: str) -> None:
    workers = {f"e-{i}": await start_worker(nats_url, f"e-{i}", common_pb2.ROLE_ENCODER) for i in (1, 2, 3)}
    image_hash = bytes(range(32))
    home = max(workers, key=lambda worker_id: rendezvous_rank(image_hash, worker_id))
    async with serving(serve, settings(nats_url, "balancer-e")) as channel:
        stub = balancer_pb2_grpc.BalancerStub(channel)

        async def all_listed() -> bool:
            return await listed_ids(stub) == set(workers)

        await wait_until(all_listed)

        async def route(*excluded: str, model: str = "m") -> str:
            response = await stub.RouteEncoder(
                balancer_pb2.RouteEncoderRequest(
                    request_id="r", model=model, image_hash=image_hash, exclude_worker_ids=excluded
                )
            )
            return str(response.encoder.worker_id)

        assert [await route() for _ in range(2)] == [home, home]  # the same image: where its embeddings are cached
        assert await route(home) != home
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await route(model="other")
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error.value.details() == "no encoder worker serves 'other' images"
    await stop_workers(workers)
