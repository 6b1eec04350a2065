"""Gateway replicas on one port (KVMESH_REUSE_PORT, as `kvmesh up --gateway 2` runs them): two real gateway
processes share the REST and gRPC ports and the kernel spreads connections over both; SIGKILL of one ends its
own streams at once with a connection error, never a hang, and the other goes on serving.

The workers are the scripted fakes of tests/services/gateway_harness.py (in this process); the gateways are
`kvmesh serve gateway` child processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from kvmesh.nats_server import EmbeddedNats, free_port
from mesh.bus import Bus

from .gateway_harness import KEY, MODEL, Fakes, Script

pytestmark = pytest.mark.asyncio(loop_scope="module")

GATEWAY_HEADER = "x-kvmesh-gateway-worker"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000}


def start_gateway(index: int, nats_url: str, http_port: int, grpc_port: int, state_dir: Path) -> subprocess.Popen:
    env = os.environ | {
        "KVMESH_NATS_URL": nats_url,
        "KVMESH_WORKER_ID": f"gateway-{index}",
        "KVMESH_HTTP_PORT": str(http_port),
        "KVMESH_GRPC_PORT": str(grpc_port),
        "KVMESH_REUSE_PORT": "1",
        "KVMESH_MODELS": MODEL,
        "KVMESH_API_KEYS": KEY,
        "KVMESH_STATE_DIR": str(state_dir),
        "KVMESH_SERVER_SECRET": "replicas-test-secret",
        "KVMESH_HEARTBEAT_INTERVAL_S": "0.5",
        "KVMESH_LOG_LEVEL": "warning",
        "KVMESH_DRAIN_TIMEOUT_S": "1",
    }
    log = (state_dir / f"gateway-{index}.log").open("w")
    command = [sys.executable, "-m", "kvmesh", "serve", "gateway"]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def nats() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fakes(nats: EmbeddedNats) -> AsyncIterator[Fakes]:
    fakes = Fakes()
    server = await fakes.serve()
    bus = await Bus.connect(nats.url, name="fake-workers")
    announcers = fakes.announcers(bus)
    for announcer in announcers:
        await announcer.start()
    yield fakes
    for announcer in announcers:
        await announcer.stop()
    await bus.close()
    await server.stop(grace=None)


async def chat(url: str, stream: bool = False) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse]:
    """One request on a connection of its own (a new connection is what the kernel spreads)."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    headers = {"Authorization": f"Bearer {KEY}"}
    response = await session.post(f"{url}/v1/chat/completions", json={**BODY, "stream": stream}, headers=headers)
    return session, response


async def served_by(url: str, starting: bool = False) -> str | None:
    """The replica that served a completion. `starting`: None from a replica that is up but has not yet heard the
    workers' heartbeats (503, "retry shortly"), as the start-up loop's probes may reach one the moment it binds."""
    session, response = await chat(url)
    async with session, response:
        if starting and response.status == 503:
            return None
        assert response.status == 200, await response.text()
        return response.headers[GATEWAY_HEADER]


async def test_replicas_share_the_port_and_a_killed_one_takes_only_its_streams(
    fakes: Fakes, nats: EmbeddedNats, tmp_path: Path
) -> None:
    tokenizer_ids = list(range(100, 160))
    # Instant answers while the gateways start: which replica a new connection reaches is the kernel's choice,
    # not a matter of time, and each probe too early is a connection error or a 503 (retried) rather than a wait.
    fakes.script = Script(token_ids=tokenizer_ids, batch_size=1)
    http_port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    gateways = [start_gateway(i, nats.url, http_port, grpc_port, tmp_path) for i in range(2)]
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 180
        while seen != {"gateway-0", "gateway-1"}:  # both up, both handed connections
            assert time.monotonic() < deadline, f"served only by {seen}; see {tmp_path}"
            assert all(g.poll() is None for g in gateways), f"a gateway exited; see {tmp_path}"
            try:
                replica = await served_by(url, starting=True)
            except aiohttp.ClientConnectionError:
                replica = None
            if replica is None:
                await asyncio.sleep(0.5)
            else:
                seen.add(replica)
        # A 30 s stream of text: still running when a gateway dies. Ids 100-190 are raw bytes that the gateway
        # holds back until they form a character (18 s at this pace before a first chunk); 270 and 305 are
        # " the" and " and" in deepseek-tiny's tokenizer, text from the first token.
        fakes.script.token_ids, fakes.script.batch_delay_s = [270, 305] * 75, 0.2

        streams: dict[str, list[tuple[aiohttp.ClientSession, aiohttp.ClientResponse]]] = {
            "gateway-0": [],
            "gateway-1": [],
        }
        for _ in range(40):
            if all(len(s) >= 2 for s in streams.values()):
                break
            session, response = await chat(url, stream=True)
            assert response.status == 200
            await response.content.readline()  # the first chunk: the stream is under way
            streams[response.headers[GATEWAY_HEADER]].append((session, response))
        assert all(len(s) >= 2 for s in streams.values()), {k: len(v) for k, v in streams.items()}

        gateways[0].send_signal(signal.SIGKILL)
        gateways[0].wait(timeout=10)
        started = time.monotonic()
        for session, response in streams["gateway-0"]:
            with pytest.raises(aiohttp.ClientPayloadError):  # cut, not hung: the connection was reset
                await asyncio.wait_for(response.read(), timeout=5)
            await session.close()
        assert time.monotonic() - started < 5
        for session, response in streams["gateway-1"]:
            body = await asyncio.wait_for(response.read(), timeout=60)
            assert body.endswith(b"data: [DONE]\n\n")
            await session.close()
        fakes.script.token_ids, fakes.script.batch_delay_s = tokenizer_ids, 0.0
        assert [await served_by(url) for _ in range(6)] == ["gateway-1"] * 6  # new connections: the survivor
    finally:
        for gateway in gateways:
            if gateway.poll() is None:
                gateway.send_signal(signal.SIGTERM)
        for gateway in gateways:
            gateway.wait(timeout=60)
