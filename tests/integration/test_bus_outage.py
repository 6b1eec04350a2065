"""NATS is not on the request path: SIGKILL the NATS server under a steady load against a real mesh, keep it down
for seconds, start it again on the same port and store. No request fails; a decode worker SIGKILLed while NATS is
down leaves the balancer's pool within 2 s (gRPC health checks, mesh.health); after recovery the global KV index
(the KVMESH_KV stream, replayed) holds exactly what the store node holds, events of the outage included
(mesh.outbox)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import openai
import pytest

from kvmesh.up import Mesh
from mesh.bus import Bus
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import KVEventFollower

from .conftest import API_KEY, scrape, start_mesh, wait_until

MODEL = "smollm2-135m"
TEXT = "The tide rises over the harbour wall while gulls circle the fishing boats at dawn."


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("bus-outage")
    mesh = start_mesh(base / "mesh.log", prefill=1, decode=2, kvcache=1, encoder=0, models=(MODEL,))
    yield mesh
    mesh.stop()


class Load:
    """`num_clients` threads, each sending chat requests one after another (a new prompt each: new KV blocks)."""

    def __init__(self, mesh: Mesh, num_clients: int) -> None:
        self.client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        self.num_ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(num_clients)]

    def _run(self, client_index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = f"Client {client_index}, request {n}: {TEXT} {TEXT} What rises?"
            try:
                response = self.client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=3, temperature=0
                )
                assert response.choices[0].message.content is not None
                self.num_ok += 1
            except Exception as exc:  # every failure is the test's finding
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)


def pool_size(mesh: Mesh, pool: str) -> float:
    return scrape(mesh.child("balancer-0").http_port, "kvmesh_balancer_workers").get(f'{{pool="{pool}"}}', -1)


def store_blocks(mesh: Mesh) -> float:
    return scrape(mesh.child("kvcache-0").http_port, "kvmesh_kvcache_blocks").get('{tier="host"}', 0)


def balancer_index_blocks(mesh: Mesh) -> float:
    return scrape(mesh.child("balancer-0").http_port, "kvmesh_kv_index_blocks").get("", -1)


async def replayed_index(mesh: Mesh) -> GlobalKVIndex:
    """The global KV index as the KVMESH_KV stream has it: a fresh follower's, replayed from the stream."""
    bus = await Bus.connect(mesh.nats_url, "test-bus-outage", tls=mesh.nats_tls)
    try:
        index = GlobalKVIndex()
        follower = KVEventFollower(bus, index)
        await follower.start()
        assert await follower.wait_caught_up(timeout_s=20)
        await follower.stop()
        return index
    finally:
        await bus.close()


def index_agrees(mesh: Mesh) -> bool:
    """The store node's holdings are what the stream says it holds, and the balancer's live index (which followed
    the stream through the outage) has every block the stream has."""
    index = asyncio.run(replayed_index(mesh))
    return (index.num_blocks("kvcache-0"), index.num_blocks()) == (store_blocks(mesh), balancer_index_blocks(mesh))


def test_nats_killed_under_load_fails_no_request_and_loses_no_kv_event(mesh: Mesh) -> None:
    nats = mesh.nats
    assert nats is not None and nats.process is not None
    blocks_before = store_blocks(mesh)
    with Load(mesh, num_clients=2) as load:
        wait_until(lambda: load.num_ok >= 4, 60, "traffic flowing")
        nats.process.kill()  # SIGKILL: no goodbye to anyone
        nats.process.wait()
        killed_at = time.monotonic()
        num_ok_at_kill = load.num_ok
        time.sleep(2.0)
        assert pool_size(mesh, "decode") == 2  # nobody was pruned for the heartbeats NATS did not carry

        mesh.kill("decode-1", signal.SIGKILL)  # a worker that really dies while NATS is away
        decode_killed_at = time.monotonic()
        wait_until(lambda: pool_size(mesh, "decode") == 1, 5, "the dead decode worker ejected")
        ejected_after_s = time.monotonic() - decode_killed_at

        time.sleep(max(0.0, killed_at + 6.0 - time.monotonic()))  # NATS down for 6 s in all
        num_ok_during_outage = load.num_ok - num_ok_at_kill
        nats.start()  # the same port and store: JetStream keeps its streams
        restarted_at = time.monotonic()
        wait_until(lambda: load.num_ok >= num_ok_at_kill + num_ok_during_outage + 4, 60, "traffic after the outage")
    recovered_s = time.monotonic() - restarted_at

    assert load.failures == []
    assert num_ok_during_outage > 0  # requests were served while NATS was down
    assert ejected_after_s < 2.0
    assert pool_size(mesh, "decode") == 1  # and it stays out: it is dead
    assert store_blocks(mesh) > blocks_before
    wait_until(lambda: index_agrees(mesh), 20, "the index to agree with the store and the balancer")
    held = store_blocks(mesh)
    print(
        f"\nNATS down 6 s: {load.num_ok} requests ok, 0 failed ({num_ok_during_outage} during the outage); "
        f"dead decode ejected after {ejected_after_s:.2f} s; traffic resumed check {recovered_s:.1f} s; "
        f"store holds {held:.0f} blocks, index agrees"
    )
