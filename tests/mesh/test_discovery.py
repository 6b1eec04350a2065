"""The address a worker announces: what peers will dial, so it must be one they can reach; and who is alive,
counted from heartbeats over a real NATS."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvmesh.nats_server import EmbeddedNats
from mesh.bus import Bus
from mesh.discovery import MISSED_HEARTBEATS, Announcer, WorkerRegistry, address_towards, advertise_host
from mesh.pb import common_pb2

INTERVAL_S = 0.5  # wide margins: a loaded CI machine delays beats too


def test_a_configured_address_wins():
    assert advertise_host("0.0.0.0", "prefill-7.example", "nats://127.0.0.1:4222") == "prefill-7.example"


def test_a_specific_bind_host_is_announced_as_it_is():
    assert advertise_host("10.1.2.3", "", "nats://127.0.0.1:4222") == "10.1.2.3"


def test_bound_to_every_interface_it_announces_the_address_facing_the_bus():
    assert advertise_host("0.0.0.0", "", "nats://127.0.0.1:4222") == "127.0.0.1"
    assert advertise_host("", "", "nats://user:secret@127.0.0.1:4222,nats://192.0.2.9:4222") == "127.0.0.1"
    assert address_towards("nats://127.0.0.1") == "127.0.0.1"  # no port: NATS's default


def test_an_unresolvable_bus_falls_back_to_the_machine_name():
    assert address_towards("nats://no-such-host.invalid:4222") is None
    assert advertise_host("0.0.0.0", "", "nats://no-such-host.invalid:4222") == socket.gethostname()
    assert advertise_host("0.0.0.0", "", "") == socket.gethostname()


def test_a_configured_or_bound_ipv6_address_comes_in_brackets():
    assert advertise_host("::1", "", "") == "[::1]"
    assert advertise_host("0.0.0.0", "fd00::7", "") == "[fd00::7]"
    assert advertise_host("0.0.0.0", "[fd00::7]", "") == "[fd00::7]"


def test_an_ipv6_address_comes_in_brackets():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.connect(("::1", 4222))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    assert advertise_host("::", "", "nats://[::1]:4222") == "[::1]"


@pytest.fixture
async def beating(tmp_path: Path) -> AsyncIterator[tuple[Announcer, WorkerRegistry, list[str]]]:
    """A prefill worker's Announcer and a registry following prefill, both in this event loop."""
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        bus = await Bus.connect(nats.url, "test-discovery")
        left: list[str] = []
        registry = WorkerRegistry(
            bus, [common_pb2.ROLE_PREFILL], INTERVAL_S, on_leave=lambda w: left.append(w.worker_id)
        )
        await registry.start()
        info = common_pb2.WorkerInfo(worker_id="prefill-a", role=common_pb2.ROLE_PREFILL, address="127.0.0.1:1")
        announcer = Announcer(bus, info, common_pb2.WorkerLoad, INTERVAL_S)
        await announcer.start()
        try:
            for _ in range(100):
                if registry.get("prefill-a") is not None:
                    break
                await asyncio.sleep(0.02)
            assert registry.get("prefill-a") is not None
            yield announcer, registry, left
        finally:
            await announcer.stop()
            await registry.stop()
            await bus.close()


async def test_a_stalled_loop_does_not_count_as_silence(beating):
    """While the loop is blocked nobody's beats can be read; after it the worker must still be there."""
    _, registry, left = beating
    time.sleep(2 * MISSED_HEARTBEATS * INTERVAL_S)  # the whole loop stalls, as a long synchronous step would
    await asyncio.sleep(2 * INTERVAL_S)  # the prune wakes first, then the beats waiting in the socket are read
    assert (registry.get("prefill-a") is not None, left) == (True, [])


async def test_a_silent_worker_still_leaves(beating):
    announcer, registry, left = beating
    assert announcer._task is not None
    announcer._task.cancel()  # it stops beating without announcing that it leaves, as a killed process would
    started = time.monotonic()
    while registry.get("prefill-a") is not None:
        assert time.monotonic() - started < 10 * INTERVAL_S
        await asyncio.sleep(0.02)
    waited = time.monotonic() - started
    assert left == ["prefill-a"] and waited >= (MISSED_HEARTBEATS - 1) * INTERVAL_S
