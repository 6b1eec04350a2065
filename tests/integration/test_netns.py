"""The mesh across real hosts on one machine (kvmesh.netns): every role in a network namespace of its own on a
bridge, its own address, loopback down. Each role listens only on its host's address and announces it; the gateway
serves from its namespace; KV crosses hosts over the bulk lanes (prefill to decode, prefill to the store); netem
between the prefill and decode hosts slows that pair only and fails no request. Skips where namespaces cannot be
made (not root, no iproute2), and the netem test where the kernel has no netem."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest

from kvmesh.bench.netns_bench import start_serving
from kvmesh.nats_server import free_port
from kvmesh.netns import Hosts, NetnsMesh, netem_unavailable, unavailable
from kvmesh.up import MeshPlan
from mesh import subjects
from mesh.bus import Bus
from mesh.pb import events_pb2

from .conftest import API_KEY, wait_until

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")
MODEL = "deepseek-tiny"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsMesh]:
    log_path = tmp_path_factory.mktemp("netns") / "mesh.log"
    plan = MeshPlan(
        prefill=1,
        decode=1,
        kvcache=1,
        balancer=1,
        encoder=0,
        models=(MODEL,),
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=(API_KEY,),
        env={"KVMESH_HEARTBEAT_INTERVAL_S": "0.5", "KVMESH_LOG_FORMAT": "json", "KVMESH_HEALTH_CHECK_TIMEOUT_S": "2"},
    )
    with Hosts() as hosts, log_path.open("w") as out:
        mesh = NetnsMesh(hosts, plan, out=out)
        mesh.log_path = log_path  # type: ignore[attr-defined]
        try:
            start_serving(mesh, timeout_s=420)
            yield mesh
        finally:
            mesh.stop()
    assert hosts.leftovers() == []  # every namespace, veth pair and the bridge gone


def chat(mesh: NetnsMesh, number: int) -> dict[str, object]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Host {number}: " + "the tide turns at the harbour wall " * 12}],
        "max_tokens": 3,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"{mesh.base_url}/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        return dict(json.loads(response.read()))


def metric(mesh: NetnsMesh, name: str, line_start: str) -> float:
    port = mesh.child(name).http_port
    with urllib.request.urlopen(f"http://{mesh.child_host(name)}:{port}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(line_start))


def listeners(mesh: NetnsMesh, name: str) -> set[str]:
    """The local addresses of every TCP socket listening in child `name`'s namespace."""
    namespace = mesh.hosts.hosts[name].namespace
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "ss", "-ltnH"], capture_output=True, text=True, check=True
    ).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


def test_every_role_listens_on_its_own_address_only(mesh: NetnsMesh) -> None:
    for child in mesh.children:
        assert listeners(mesh, child.name) == {mesh.child_host(child.name)}, child.name
    assert mesh.base_url == f"http://{mesh.child_host('gateway-0')}:{mesh.plan.http_port}"


async def announced(mesh: NetnsMesh) -> dict[str, tuple[str, str]]:
    """worker id -> (gRPC address, bulk lane address), from the heartbeats on NATS."""
    seen: dict[str, tuple[str, str]] = {}

    async def on_beat(beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        seen[beat.worker.worker_id] = (beat.worker.address, beat.worker.data_address)

    bus = await Bus.connect(mesh.nats_url, "test-netns", tls=mesh.nats_tls)
    try:
        await bus.subscribe(f"{subjects.HEARTBEAT_PREFIX}.>", events_pb2.WorkerHeartbeat, on_beat)
        await asyncio.sleep(2.0)  # four heartbeat intervals
    finally:
        await bus.close()
    return seen


def test_workers_announce_their_hosts_addresses(mesh: NetnsMesh) -> None:
    seen = asyncio.run(announced(mesh))
    workers = {"prefill-0", "decode-0", "kvcache-0", "balancer-0"}
    assert workers <= set(seen)
    for worker in workers:
        host = mesh.child_host(worker)
        address, data_address = seen[worker]
        assert address == f"{host}:{mesh.child(worker).grpc_port}", worker
        assert data_address.rsplit(":", 1)[0] in ("", host), worker
    assert seen["decode-0"][1].startswith(mesh.child_host("decode-0") + ":")  # decode's lane takes pushed KV
    assert seen["kvcache-0"][1].startswith(mesh.child_host("kvcache-0") + ":")


def test_kv_crosses_hosts_over_the_lanes(mesh: NetnsMesh) -> None:
    pushed_before = metric(mesh, "decode-0", 'kvmesh_kv_transfer_bytes_total{direction="prefill_to_decode"}')
    stored_before = metric(mesh, "kvcache-0", 'kvmesh_kv_transfer_bytes_total{direction="store_in"}')
    answer = chat(mesh, 1)
    assert answer["choices"]
    assert metric(mesh, "decode-0", 'kvmesh_kv_transfer_bytes_total{direction="prefill_to_decode"}') > pushed_before
    wait_until(
        lambda: metric(mesh, "kvcache-0", 'kvmesh_kv_transfer_bytes_total{direction="store_in"}') > stored_before,
        10,
        "the prompt's blocks written to the store node",
    )
    log = mesh.log_path.read_text()  # type: ignore[attr-defined]
    assert "pushing over gRPC" not in log  # the lane, not the fallback


def test_netem_slows_prefill_to_decode_only_and_fails_nothing(mesh: NetnsMesh) -> None:
    reason = netem_unavailable()
    if reason is not None:
        pytest.skip(f"no netem here: {reason}")
    hosts = mesh.hosts
    decode, kvcache = mesh.child("decode-0"), mesh.child("kvcache-0")
    hosts.impair("prefill-0", "decode-0", delay_ms=2, loss_pct=0.1)
    try:
        to_decode = hosts.connect_ms("prefill-0", mesh.child_host("decode-0"), decode.http_port)
        to_store = hosts.connect_ms("prefill-0", mesh.child_host("kvcache-0"), kvcache.http_port)
        answers = [chat(mesh, number) for number in (2, 3)]
    finally:
        hosts.clear("prefill-0", "decode-0")
    assert to_decode >= 4.0  # a SYN and its SYN-ACK, 2 ms each way
    assert to_store < to_decode - 2.0  # the store's path is not delayed
    assert all(answer["choices"] for answer in answers)
