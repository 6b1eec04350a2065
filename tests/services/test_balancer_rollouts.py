"""Canary rollouts' state (mesh.rollouts) in a real JetStream KV bucket, and a real balancer routing by it: the
canary's workers get the conversations the rollout's weight says, and none once it is rolled back."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from kvmesh.nats_server import EmbeddedNats, free_port
from mesh.bus import Bus
from mesh.discovery import Announcer
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2, events_pb2
from mesh.rollouts import RUNNING, RolloutConflict, RolloutStore, splits
from mesh.routing import Split
from services.balancer.config import BalancerSettings
from services.balancer.server import serve
from tests.services.harness import serving, wait_until

INTERVAL_S = 0.2


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats")) as nats:
        yield nats.url


def rollout(rollout_id: str, weight: int, created_ms: int = 1, model: str = "m") -> events_pb2.Rollout:
    return events_pb2.Rollout(
        rollout_id=rollout_id,
        model=model,
        stable_version="1.0",
        canary_version="2.0",
        steps=[5, 25, 50, 100],
        check_interval_s=3600,  # not judged within these tests: they move the weight by hand
        state=RUNNING,
        weight=weight,
        created_ms=created_ms,
        step_started_ms=int(time.time() * 1000),
    )


async def test_the_store_creates_once_and_updates_by_compare_and_set(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, name="rollout-store")
    store = RolloutStore(bus.client)
    try:
        revision = await store.create(rollout("cas", 5))
        with pytest.raises(RolloutConflict, match=r"^rollout 'cas' exists$"):
            await store.create(rollout("cas", 25))
        newer = await store.update(rollout("cas", 25), revision)
        with pytest.raises(RolloutConflict, match=r"^rollout 'cas' changed meanwhile$"):
            await store.update(rollout("cas", 50), revision)  # a replica that read before the last write
        found = await store.get("cas")
        assert found is not None and (found[0].weight, found[1]) == (25, newer)
        assert await store.get("nobody") is None
        assert [r.rollout_id for r in await store.list()] == ["cas"]
    finally:
        await bus.close()


def test_each_model_follows_its_latest_rollout() -> None:
    rollouts = [rollout("old", 0, created_ms=1), rollout("new", 25, created_ms=2), rollout("x", 50, model="x")]
    assert splits(rollouts) == {"m": Split("m", "2.0", 25), "x": Split("x", "2.0", 50)}
    assert splits([]) == {}


async def start_worker(bus: Bus, worker_id: str, role: int, version: str) -> Announcer:
    info = common_pb2.WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        address=f"127.0.0.1:{7000 + int(worker_id[-1])}",
        models=["m"],
        max_num_seqs=8,
        num_kv_blocks=100,
        block_size=16,
        version=version,
    )
    announcer = Announcer(bus, info, common_pb2.WorkerLoad, INTERVAL_S)
    await announcer.start()
    return announcer


async def test_the_balancer_routes_by_the_latest_rollout_weight(nats_url: str) -> None:
    buses = {name: await Bus.connect(nats_url, name=name) for name in ("p-1", "p-2", "d-1", "d-2", "admin")}
    workers = [
        await start_worker(buses["p-1"], "p-1", common_pb2.ROLE_PREFILL, "1.0"),
        await start_worker(buses["p-2"], "p-2", common_pb2.ROLE_PREFILL, "2.0"),
        await start_worker(buses["d-1"], "d-1", common_pb2.ROLE_DECODE, "1.0"),
        await start_worker(buses["d-2"], "d-2", common_pb2.ROLE_DECODE, "2.0"),
    ]
    store = RolloutStore(buses["admin"].client)
    settings = BalancerSettings(
        nats_url=nats_url,
        grpc_port=free_port(),
        http_port=free_port(),
        worker_id="balancer-r",
        heartbeat_interval_s=INTERVAL_S,
        health_check_interval_s=0,  # the workers here are heartbeats alone, with no gRPC server to check
        balancer_decode_binding="early",  # the Route's pair shows the split (late: test_routing_late_binding.py)
    )
    conversations = [
        balancer_pb2.RouteRequest(request_id=f"r{i}", model="m", block_hashes=[bytes([i]) * 32], num_prompt_tokens=32)
        for i in range(40)
    ]
    try:
        async with serving(serve, settings) as channel:
            stub = balancer_pb2_grpc.BalancerStub(channel)

            async def pairs() -> set[tuple[str, str]]:
                routes = [await stub.Route(request) for request in conversations]
                return {(r.prefill.worker_id, r.decode.worker_id) for r in routes}

            async def all_listed() -> bool:
                response = await stub.ListWorkers(balancer_pb2.ListWorkersRequest())
                return len(response.workers) == 4

            await wait_until(all_listed)
            revision = await store.create(rollout("to-2.0", 100, created_ms=10))

            async def only(expected: set[tuple[str, str]]) -> bool:
                return await pairs() == expected

            await wait_until(lambda: only({("p-2", "d-2")}))  # every conversation on the canary
            await store.update(rollout("to-2.0", 25, created_ms=10), revision)
            await wait_until(lambda: only({("p-1", "d-1"), ("p-2", "d-2")}))  # some each way, never mixed
            await store.create(rollout("older", 100, created_ms=5))  # not the model's latest: ignored
            revision = (await store.get("to-2.0") or (None, 0))[1]
            await store.update(rollout("to-2.0", 0, created_ms=10), revision)  # rolled back
            await wait_until(lambda: only({("p-1", "d-1")}))
    finally:
        for announcer in workers:
            await announcer.stop()
        for bus in buses.values():
            await bus.close()


def usage(request_id: str, decode_worker: str, ttft_ms: float, now_ms: int) -> events_pb2.UsageRecord:
    return events_pb2.UsageRecord(
        request_id=request_id,
        tenant_id="t",
        model="m",
        status="finished",
        http_status=200,
        prompt_tokens=40,
        cached_tokens=32,
        completion_tokens=11,
        ttft_ms=ttft_ms,
        e2e_ms=ttft_ms + 10 * 20.0,  # 20 ms between tokens
        prefill_worker="p-1",
        decode_worker=decode_worker,
        ended_at_ms=now_ms,
    )


def gated_rollout(rollout_id: str, now_ms: int) -> events_pb2.Rollout:
    return events_pb2.Rollout(
        rollout_id=rollout_id,
        model="m",
        stable_version="1.0",
        canary_version="2.0",
        steps=[50, 100],
        check_interval_s=0.5,
        gates=events_pb2.RolloutGates(max_ttft_p95_ratio=1.5, max_itl_p95_ratio=1.5, min_samples=5),
        state=RUNNING,
        weight=50,
        created_ms=now_ms,
        step_started_ms=now_ms,
    )


async def test_the_controller_steps_promotes_and_rolls_back_by_the_gates(nats_url: str) -> None:
    buses = {name: await Bus.connect(nats_url, name=name) for name in ("p-1", "d-1", "d-2", "gateway")}
    workers = [
        await start_worker(buses["p-1"], "p-1", common_pb2.ROLE_PREFILL, "1.0"),
        await start_worker(buses["d-1"], "d-1", common_pb2.ROLE_DECODE, "1.0"),
        await start_worker(buses["d-2"], "d-2", common_pb2.ROLE_DECODE, "2.0"),
    ]
    store = RolloutStore(buses["gateway"].client)
    settings = BalancerSettings(
        nats_url=nats_url,
        grpc_port=free_port(),
        http_port=free_port(),
        worker_id="balancer-c",
        heartbeat_interval_s=INTERVAL_S,
        health_check_interval_s=0,  # the workers here are heartbeats alone, with no gRPC server to check
    )
    num_sent = 0

    async def serve_requests(canary_ttft_ms: float) -> None:
        nonlocal num_sent
        now_ms = int(time.time() * 1000)
        for worker, ttft_ms in (("d-1", 100.0), ("d-2", canary_ttft_ms)):
            for _ in range(5):
                num_sent += 1
                await buses["gateway"].publish("kvmesh.usage.t", usage(f"u{num_sent}", worker, ttft_ms, now_ms))

    async def state_of(rollout_id: str) -> events_pb2.Rollout:
        found = await store.get(rollout_id)
        assert found is not None
        return found[0]

    try:
        async with serving(serve, settings) as channel:
            stub = balancer_pb2_grpc.BalancerStub(channel)

            async def all_listed() -> bool:
                return len((await stub.ListWorkers(balancer_pb2.ListWorkersRequest())).workers) == 3

            await wait_until(all_listed)
            await store.create(gated_rollout("good", int(time.time() * 1000)))

            async def held() -> bool:  # an interval without traffic: the step holds
                return len((await state_of("good")).decisions) > 0

            await wait_until(held)
            assert [(d.action, d.weight) for d in (await state_of("good")).decisions] == [("hold", 50)]
            await serve_requests(canary_ttft_ms=110.0)

            async def moved_to_100() -> bool:
                return (await state_of("good")).weight == 100

            await wait_until(moved_to_100)
            await serve_requests(canary_ttft_ms=110.0)

            async def promoted() -> bool:
                return (await state_of("good")).state == "promoted"

            await wait_until(promoted, timeout_s=3)
            actions = [(d.action, d.weight) for d in (await state_of("good")).decisions]
            assert actions[0] == ("hold", 50) and actions[-2:] == [("step", 100), ("promote", 100)]

            await store.create(gated_rollout("slow", int(time.time() * 1000)))
            await serve_requests(canary_ttft_ms=400.0)  # 4x stable's TTFT
            fault_s = time.time()

            async def rolled_back() -> bool:
                return (await state_of("slow")).state == "rolled_back"

            await wait_until(rolled_back, timeout_s=3)
            last = (await state_of("slow")).decisions[-1]
            assert (last.action, last.weight, last.reason) == (
                "rollback",
                0,
                "p95 TTFT 4.00x stable's, over 1.5x",
            )
            assert last.at_ms / 1000 - fault_s <= 0.5 + 0.3  # within one check interval (and a tick)
            assert REGISTRY.get_sample_value("kvmesh_rollout_canary_weight", {"model": "m"}) == 0
            assert (
                REGISTRY.get_sample_value("kvmesh_rollout_decisions_total", {"model": "m", "action": "rollback"}) == 1
            )
    finally:
        for announcer in workers:
            await announcer.stop()
        for bus in buses.values():
            await bus.close()


async def test_the_controller_judges_by_the_quality_probe_the_gateways_recorded(nats_url: str) -> None:
    """Pending: no step, however many samples; a recorded mismatch: rolled back at the next check, without any."""
    buses = {name: await Bus.connect(nats_url, name=name) for name in ("p-1", "d-1", "d-2", "gateway")}
    workers = [
        await start_worker(buses["p-1"], "p-1", common_pb2.ROLE_PREFILL, "1.0"),
        await start_worker(buses["d-1"], "d-1", common_pb2.ROLE_DECODE, "1.0"),
        await start_worker(buses["d-2"], "d-2", common_pb2.ROLE_DECODE, "2.0"),
    ]
    store = RolloutStore(buses["gateway"].client)
    settings = BalancerSettings(
        nats_url=nats_url,
        grpc_port=free_port(),
        http_port=free_port(),
        worker_id="balancer-q",
        heartbeat_interval_s=INTERVAL_S,
    )
    prompt = events_pb2.QualityPrompt(text="What is the capital of France?", token_ids=[1, 2, 3])
    try:
        async with serving(serve, settings) as channel:
            stub = balancer_pb2_grpc.BalancerStub(channel)

            async def all_listed() -> bool:
                return len((await stub.ListWorkers(balancer_pb2.ListWorkersRequest())).workers) == 3

            await wait_until(all_listed)
            now_ms = int(time.time() * 1000)
            probed = gated_rollout("probed", now_ms)
            probed.model = "q"
            probed.gates.quality_prompts.append(prompt)
            probed.gates.min_samples = 1
            counted_before = REGISTRY.get_sample_value("kvmesh_rollout_samples_total", {"model": "q"}) or 0
            for n, worker in enumerate(("d-1", "d-2")):
                record = usage(f"q{n}", worker, 100.0, now_ms)
                record.model = "q"
                await buses["gateway"].publish("kvmesh.usage.t", record)

            async def counted() -> bool:  # kept though no rollout of "q" is heard yet; ended at its start
                return REGISTRY.get_sample_value("kvmesh_rollout_samples_total", {"model": "q"}) == counted_before + 2

            await wait_until(counted)
            await store.create(probed)

            async def decisions() -> list[tuple[str, str]]:
                found = await store.get("probed")
                assert found is not None
                return [(d.action, d.reason) for d in found[0].decisions]

            async def checked() -> bool:
                return len(await decisions()) > 0

            await wait_until(checked)
            assert (await decisions())[0] == ("hold", "quality probe pending")  # the samples are there: 1 of 1
            found = await store.get("probed")
            assert found is not None
            rollout, revision = found
            reason = "quality probe: prompt 0 ('What is the capital of France?') differs at token 1: canary 9, stable 7"
            rollout.quality.CopyFrom(events_pb2.QualityOutcome(result="mismatch", reason=reason, at_ms=now_ms))
            await store.update(rollout, revision)
            recorded_s = time.time()

            async def rolled_back() -> bool:
                return (await decisions())[-1][0] == "rollback"

            await wait_until(rolled_back, timeout_s=3)
            found = await store.get("probed")
            assert found is not None and (found[0].state, found[0].weight) == ("rolled_back", 0)
            assert (await decisions())[-1] == ("rollback", reason)
            assert found[0].decisions[-1].at_ms / 1000 - recorded_s <= 0.5 + 0.3  # within one check interval
    finally:
        for announcer in workers:
            await announcer.stop()
        for bus in buses.values():
            await bus.close()
