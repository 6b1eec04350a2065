"""The mesh on a 3-node NATS cluster (`kvmesh up --nats-cluster 3`): every stream and bucket it creates has 3
JetStream replicas; SIGKILL the node that leads JetStream (the meta group and, moved there first, every stream)
under steady traffic of chats and stored responses. No request fails, every request's usage record reaches the
ledger, and the global KV index replayed from the stream holds exactly what the store node holds."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest

from kvmesh.bench.load import Load
from kvmesh.bench.outboxes import kv_index_agrees
from kvmesh.nats_cluster import NatsCluster
from kvmesh.up import Mesh
from mesh.bus import Bus
from mesh.kv_stream import STREAM as KV_STREAM

from .conftest import API_KEY, scrape, start_mesh, wait_until

MODEL = "deepseek-tiny"
REQUESTS_PER_OUTCOME = {"chat": 1, "responses": 2}  # a stored response, then a follow-up naming it


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("nats-cluster")
    env = {"KVMESH_DATABASE_URL": f"sqlite:///{base / 'kvmesh.db'}", "KVMESH_HEALTH_CHECK_TIMEOUT_S": "2.0"}
    mesh = start_mesh(
        base / "mesh.log", env, prefill=1, decode=1, kvcache=1, encoder=0, models=(MODEL,), nats_cluster=3
    )
    mesh.database = base / "kvmesh.db"  # type: ignore[attr-defined]
    yield mesh
    mesh.stop()


async def with_bus(mesh: Mesh, work):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(mesh.nats_url, "test-nats-cluster", tls=mesh.nats_tls)
    try:
        return await work(bus)
    finally:
        await bus.close()


async def stream_layout(bus: Bus) -> dict[str, tuple[int, str | None]]:
    """Every stream (KV buckets are streams KV_<bucket>): its replicas and its leader's server name."""
    layout = {}
    for info in await bus.client.jetstream(timeout=2).streams_info():
        name = info.config.name or ""
        layout[name] = (info.config.num_replicas or 1, info.cluster.leader if info.cluster else None)
    return layout


def leads_everything(mesh: Mesh, server_name: str) -> bool:
    """Whether `server_name` leads every stream; no answer (the JetStream API can miss one while leaders move,
    `nats: timeout` in a full run) is a no for now, asked again."""
    try:
        layout = asyncio.run(with_bus(mesh, stream_layout))
    except nats.errors.TimeoutError:
        return False
    return {lead for _, lead in layout.values()} == {server_name}


async def lead_everything_from(bus: Bus, server_name: str, streams: list[str]) -> None:
    """Move each stream's leadership to `server_name` (a stepdown with a preferred successor)."""
    payload = json.dumps({"placement": {"preferred": server_name}}).encode()
    for name in streams:
        await bus.client.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{name}", payload, timeout=5)


async def kv_stream_leader(bus: Bus) -> str | None:
    try:
        info = await bus.client.jetstream(timeout=0.5).stream_info(KV_STREAM)
    except Exception:  # no leader to answer yet
        return None
    return info.cluster.leader if info.cluster else None


def store_blocks(mesh: Mesh) -> float:
    return scrape(mesh.child("kvcache-0").http_port, "kvmesh_kvcache_blocks").get('{tier="host"}', 0)


def usage_records(database: Path) -> int:
    with sqlite3.connect(database) as connection:
        return int(connection.execute("SELECT count(*) FROM usage_records WHERE status = 'finished'").fetchone()[0])


def test_every_stream_and_bucket_has_three_replicas(mesh: Mesh) -> None:
    layout = asyncio.run(with_bus(mesh, stream_layout))
    assert {KV_STREAM, "KVMESH_USAGE"} <= set(layout)
    assert {name: replicas for name, (replicas, _) in layout.items()} == {name: 3 for name in layout}


def test_leader_killed_under_load_fails_no_request_and_loses_no_record(mesh: Mesh) -> None:
    cluster = mesh.nats
    assert isinstance(cluster, NatsCluster)
    load = Load(mesh.base_url, API_KEY, MODEL, concurrency=2, kinds=("chat", "responses"), max_tokens=4).start()
    try:
        wait_until(lambda: len(load.outcomes()) >= 4, 60, "traffic flowing")
        leader = cluster.meta_leader()
        assert leader is not None
        streams = list(asyncio.run(with_bus(mesh, stream_layout)))  # the Responses bucket exists by now
        asyncio.run(with_bus(mesh, lambda bus: lead_everything_from(bus, leader, streams)))
        wait_until(lambda: leads_everything(mesh, leader), 20, f"{leader} leading every stream")
        num_done_at_kill = len(load.outcomes())
        cluster.kill(leader)
        killed_at = time.monotonic()
        new_stream_leader = asyncio.run(with_bus(mesh, lambda bus: wait_new_leader(bus, leader)))
        stream_leader_s = time.monotonic() - killed_at
        wait_until(lambda: cluster.meta_leader() not in (None, leader), 30, "a new meta leader")
        meta_leader_s = time.monotonic() - killed_at
        wait_until(lambda: len(load.outcomes()) >= num_done_at_kill + 6, 60, "traffic after the election")
    finally:
        load.stop()

    outcomes = load.outcomes()
    assert [o.detail or o.error for o in outcomes if not o.is_ok] == []
    assert new_stream_leader != leader
    num_requests = sum(REQUESTS_PER_OUTCOME[o.kind] for o in outcomes)
    database: Path = mesh.database  # type: ignore[attr-defined]
    wait_until(lambda: usage_records(database) == num_requests, 30, f"{num_requests} usage records in the ledger")
    assert store_blocks(mesh) > 0
    wait_until(lambda: kv_index_agrees(mesh), 20, "the index to agree with the store and the balancer")
    print(
        f"\nNATS cluster of 3, {leader} (meta and every stream leader) SIGKILLed: {len(outcomes)} requests ok, "
        f"0 failed, {num_requests} usage records; new KV stream leader {new_stream_leader} after "
        f"{stream_leader_s:.2f} s, new meta leader after {meta_leader_s:.2f} s; index agrees"
    )


async def wait_new_leader(bus: Bus, old: str, timeout_s: float = 30.0) -> str:
    """The KV stream's new leader, as soon as one answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leader = await kv_stream_leader(bus)
        if leader not in (None, old):
            return str(leader)
        await asyncio.sleep(0.05)
    raise TimeoutError("no new KV stream leader")
