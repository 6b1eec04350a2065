"""Canary rollouts' state (mesh.rollouts) in a real JetStream KV bucket, and a real balancer routing by it: the
canary's workers get the conversations the rollout's weight says, and none once it is rolled back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
        state=RUNNING,
        weight=weight,
        created_ms=created_ms,
    )


async def test_the_store_creates_once_and_updates_by_compare_and_set(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, name="rollout-store")
    store = RolloutStore(bus)
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
    store = RolloutStore(buses["admin"])
    settings = BalancerSettings(
        nats_url=nats_url,
        grpc_port=free_port(),
        http_port=free_port(),
        worker_id="balancer-r",
        heartbeat_interval_s=INTERVAL_S,
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
