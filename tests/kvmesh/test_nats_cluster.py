"""`kvmesh up --nats-cluster 3`'s NATS: three real nats-server processes joined by authenticated routes, whose
children are told every node and JetStream replicas 3; a stream a child creates lives on all three. And the
pieces around it: the plan's checks, the replicas setting's, and `through_election`'s retries."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.js.errors import KeyNotFoundError

from kvmesh.nats_cluster import NatsCluster, monitor
from kvmesh.up import Mesh, MeshPlan
from mesh import kv_stream
from mesh.access import KVCACHE
from mesh.bus import Bus, through_election
from mesh.bus_auth import read_user
from mesh.config import NatsSettings, SettingError, TLSSettings, load_settings
from mesh.tls import client_ssl_context, load_credentials


@pytest.fixture
def clustered(monkeypatch: pytest.MonkeyPatch) -> Iterator[Mesh]:
    """A mesh's 3-node NATS as `kvmesh up --nats-cluster 3` starts it (TLS, a user per child), and no children."""
    monkeypatch.delenv("KVMESH_TLS_DIR")
    monkeypatch.delenv("KVMESH_JETSTREAM_REPLICAS", raising=False)
    mesh = Mesh(MeshPlan(nats_cluster=3), out=io.StringIO())
    mesh.certificates = mesh.throwaway_certificates()
    mesh.start_nats()
    yield mesh
    mesh.stop()


async def test_a_child_creates_its_stream_on_every_node(clustered: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = clustered.nats
    assert isinstance(cluster, NatsCluster)
    env = clustered.child_env(KVCACHE, 0, 0)
    ports = [node.port for node in cluster.nodes]
    assert env["KVMESH_NATS_URL"] == ",".join(f"tls://127.0.0.1:{port}" for port in ports)
    assert env["KVMESH_JETSTREAM_REPLICAS"] == "3"
    peers = [sorted({route["remote_name"] for route in monitor(node, "routez")["routes"]}) for node in cluster.nodes]
    assert peers == [["nats-1", "nats-2"], ["nats-0", "nats-2"], ["nats-0", "nats-1"]]
    credentials = load_credentials(KVCACHE, TLSSettings(tls_dir=env["KVMESH_TLS_DIR"]))
    assert credentials is not None
    user = read_user(Path(env["KVMESH_NATS_CREDS"]))
    bus = await Bus.connect(env["KVMESH_NATS_URL"], "kvcache-0", 2.0, user, client_ssl_context(credentials))
    monkeypatch.setenv("KVMESH_JETSTREAM_REPLICAS", env["KVMESH_JETSTREAM_REPLICAS"])
    try:
        assert await kv_stream.ensure_kv_stream(bus)
        info = await bus.client.jetstream().stream_info(kv_stream.STREAM)
    finally:
        await bus.close()
    assert info.config.num_replicas == 3 and info.cluster is not None
    assert sorted([info.cluster.leader, *(peer.name for peer in info.cluster.replicas or [])]) == [
        "nats-0",
        "nats-1",
        "nats-2",
    ]


def test_a_cluster_has_at_least_three_nodes_and_no_url_of_its_own() -> None:
    with pytest.raises(ValueError, match=r"--nats-cluster must be 1 .* or at least 3"):
        MeshPlan(nats_cluster=2)
    with pytest.raises(ValueError, match="cannot go with --nats URL"):
        MeshPlan(nats_cluster=3, nats_url="nats://elsewhere:4222")
    with pytest.raises(ValueError, match="at least 3 nodes"):
        NatsCluster(2)


def test_replicas_are_one_to_five() -> None:
    assert load_settings(NatsSettings, {}).jetstream_replicas == 1
    with pytest.raises(SettingError, match="KVMESH_JETSTREAM_REPLICAS=6"):
        load_settings(NatsSettings, {"KVMESH_JETSTREAM_REPLICAS": "6"})


async def test_through_election_retries_silence_not_answers() -> None:
    calls: list[int] = []

    async def silent_twice() -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise nats.errors.NoRespondersError
        return "stored"

    assert await through_election(silent_twice, budget_s=5.0) == "stored"
    assert len(calls) == 3

    async def not_found() -> None:
        calls.append(1)
        raise KeyNotFoundError

    calls.clear()
    with pytest.raises(KeyNotFoundError):
        await through_election(not_found, budget_s=5.0)
    assert len(calls) == 1  # an answer: not asked again

    async def always_silent() -> None:
        raise nats.errors.TimeoutError

    started = asyncio.get_running_loop().time()
    with pytest.raises(nats.errors.TimeoutError):
        await through_election(always_silent, budget_s=0.5)
    assert asyncio.get_running_loop().time() - started < 1.0
