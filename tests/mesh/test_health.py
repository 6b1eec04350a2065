"""Liveness without NATS (mesh.health, mesh.discovery): a registry whose workers are health-checked over gRPC
ejects one whose gRPC is gone within 2 s, even while its heartbeats still arrive, and re-admits it when it
answers again; while NATS is down nobody is pruned for silence, workers are only marked stale. Real NATS
(SIGKILLed), real gRPC servers on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import rpc
from mesh.bus import Bus
from mesh.discovery import MISSED_HEARTBEATS, Announcer, WorkerRegistry
from mesh.health import HealthServicer, is_serving
from mesh.pb import common_pb2, health_pb2_grpc

INTERVAL_S = 0.2  # heartbeats and health checks alike


async def health_server(port: int, worker_id: str) -> grpc.aio.Server:
    server = rpc.create_server(None)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(worker_id, lambda: True), server)
    rpc.bind(server, "127.0.0.1", port, None)
    await server.start()
    return server


async def wait_for(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held (fails after `timeout_s`)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


@pytest.fixture
async def checked(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedNats, WorkerRegistry, grpc.aio.Server, list[str]]]:
    """A decode worker (its Announcer and a gRPC health server) and a health-checking registry following it."""
    port = free_port()
    server = await health_server(port, "decode-a")
    channels = rpc.Channels(None)
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        bus = await Bus.connect(nats.url, "test-health")
        left: list[str] = []
        registry = WorkerRegistry(
            bus, [common_pb2.ROLE_DECODE], INTERVAL_S, on_leave=lambda w: left.append(w.worker_id)
        )
        registry.check_health(channels, INTERVAL_S, timeout_s=0.2)
        await registry.start()
        info = common_pb2.WorkerInfo(worker_id="decode-a", role=common_pb2.ROLE_DECODE, address=f"127.0.0.1:{port}")
        announcer = Announcer(bus, info, common_pb2.WorkerLoad, INTERVAL_S)
        await announcer.start()
        try:
            await wait_for(lambda: len(registry.workers()) == 1, 5)
            yield nats, registry, server, left
        finally:
            await announcer.stop()
            await registry.stop()
            await bus.close()
            await server.stop(None)
            await channels.close()


async def test_health_is_answered_for_the_process_and_its_worker_id_only() -> None:
    port = free_port()
    server = await health_server(port, "decode-a")
    channels = rpc.Channels(None)
    try:
        channel = channels.get(f"127.0.0.1:{port}")
        answers = [await is_serving(channel, name, 1.0) for name in ("", "decode-a", "decode-b")]
    finally:
        await server.stop(None)
        await channels.close()
    assert answers == [True, True, False]


async def test_a_worker_whose_grpc_is_gone_is_ejected_within_2_s_and_readmitted(checked) -> None:
    _, registry, server, left = checked
    port = int(registry.addresses()["decode-a"].rpartition(":")[2])
    await server.stop(None)  # its heartbeats go on: only gRPC is gone
    ejected_s = await wait_for(lambda: registry.workers() == [], 2.0)
    assert registry.is_ejected("decode-a") and registry.get("decode-a") is not None
    await asyncio.sleep(MISSED_HEARTBEATS * INTERVAL_S)
    assert registry.workers() == [] and left == []  # a heartbeat does not re-admit what fails its checks

    again = await health_server(port, "decode-a")
    try:
        await wait_for(lambda: len(registry.workers()) == 1, 3.0)
    finally:
        await again.stop(None)
    assert ejected_s < 2.0


async def test_while_nats_is_down_a_silent_worker_stays_marked_stale(checked) -> None:
    """Both with health checks and without (a registry that only has heartbeats excuses the outage's silence)."""
    nats, registry, _, left = checked
    plain = WorkerRegistry(registry.bus, [common_pb2.ROLE_DECODE], INTERVAL_S)
    await plain.start()
    try:
        await wait_for(lambda: len(plain.workers()) == 1, 5)
        assert nats.process is not None
        nats.process.kill()  # heartbeats stop for everyone
        nats.process.wait()
        await asyncio.sleep(3 * MISSED_HEARTBEATS * INTERVAL_S)
        for followed in (registry, plain):
            worker = followed.get("decode-a")
            assert worker is not None and worker.is_stale and [w.worker_id for w in followed.workers()] == ["decode-a"]
        assert left == [] and not registry.bus.is_connected

        nats.start()  # same port and store: the announcer's beats come back
        await wait_for(lambda: not registry.get("decode-a").is_stale and not plain.get("decode-a").is_stale, 5.0)
        assert left == []
    finally:
        await plain.stop()


class LateHealth(HealthServicer):
    """A worker too busy to answer within the checker's deadline (as on a loaded machine)."""

    async def Check(self, request, context):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.5)
        return await super().Check(request, context)


async def test_lateness_alone_never_ejects_the_last_worker_of_a_role(tmp_path: Path) -> None:
    """Two decode workers that answer late: one is ejected, the other stays in the pool (an empty pool fails every
    request); a refused check still ejects the last one."""
    servers, infos = [], []
    for name in ("decode-a", "decode-b"):
        port = free_port()
        server = rpc.create_server(None)
        health_pb2_grpc.add_HealthServicer_to_server(LateHealth(name, lambda: True), server)
        rpc.bind(server, "127.0.0.1", port, None)
        await server.start()
        servers.append(server)
        infos.append(common_pb2.WorkerInfo(worker_id=name, role=common_pb2.ROLE_DECODE, address=f"127.0.0.1:{port}"))
    channels = rpc.Channels(None)
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        bus = await Bus.connect(nats.url, "test-health")
        registry = WorkerRegistry(bus, [common_pb2.ROLE_DECODE], INTERVAL_S)
        registry.check_health(channels, INTERVAL_S, timeout_s=0.1)
        await registry.start()
        announcers = [Announcer(bus, info, common_pb2.WorkerLoad, INTERVAL_S) for info in infos]
        try:
            for announcer in announcers:
                await announcer.start()
            await wait_for(lambda: len(registry.addresses()) == 2, 5)
            await wait_for(lambda: registry.num_ejected == 1, 5)
            await asyncio.sleep(10 * INTERVAL_S)  # many more late rounds
            assert registry.num_ejected == 1 and len(registry.workers()) == 1
            (kept,) = registry.workers()
            await servers[[i.worker_id for i in infos].index(kept.worker_id)].stop(None)  # now refused
            await wait_for(lambda: registry.workers() == [], 3)
        finally:
            for announcer in announcers:
                await announcer.stop()
            await registry.stop()
            await bus.close()
            for server in servers:
                await server.stop(None)
            await channels.close()
