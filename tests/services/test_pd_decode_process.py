"""`python -m services.decode` as a real process: it announces itself on NATS and stops gracefully on SIGTERM.

Harness: the `mesh` fixture of tests/services/pd_harness.py (in-process workers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from mesh import subjects
from mesh.bus import Bus
from mesh.pb import common_pb2, events_pb2

from . import pd_harness
from .pd_harness import LLAMA_BLOCK_BYTES, Mesh, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, nats_url = pd_harness.mesh, pd_harness.nats_url  # fixtures: each test file starts its own mesh


async def test_the_decode_process_announces_itself_and_stops_gracefully_on_sigterm(mesh: Mesh):
    heard: list[events_pb2.WorkerHeartbeat] = []

    async def on_beat(beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        if beat.worker.worker_id == "decode-process":
            heard.append(beat)

    bus = await Bus.connect(mesh.nats_url, "test-process")
    await bus.subscribe(subjects.heartbeat("decode"), events_pb2.WorkerHeartbeat, on_beat)
    env = {
        **os.environ,
        "KVMESH_NATS_URL": mesh.nats_url,
        "KVMESH_MODELS": mesh.llama,
        "KVMESH_WORKER_ID": "decode-process",
        "KVMESH_HEARTBEAT_INTERVAL_S": "0.2",
        "KVMESH_KV_CACHE_MEMORY_BYTES": str(16 * LLAMA_BLOCK_BYTES),
        "KVMESH_LOG_LEVEL": "warning",
        "KVMESH_VERSION": "2.0.0-canary",
    }
    process = subprocess.Popen([sys.executable, "-m", "services.decode"], env=env, stderr=subprocess.PIPE)
    try:
        await wait_until(lambda: bool(heard) or process.poll() is not None, timeout_s=60, what="its heartbeat")
        assert heard, process.stderr.read().decode() if process.stderr else ""
        info = heard[0].worker
        assert (info.role, list(info.models), info.num_kv_blocks, info.block_size, info.version) == (
            common_pb2.ROLE_DECODE,
            [mesh.llama],
            16,
            16,
            "2.0.0-canary",
        )
        process.send_signal(signal.SIGTERM)
        await wait_until(lambda: process.poll() is not None, timeout_s=30, what="the process to exit")
        assert process.returncode == 0
        await wait_until(lambda: heard[-1].leaving, timeout_s=5, what="its leaving heartbeat")
    finally:
        if process.poll() is None:
            process.kill()
        await bus.close()


async def test_the_decode_process_refuses_a_fault_setting_without_the_allowance(mesh: Mesh):
    env = {**os.environ, "KVMESH_NATS_URL": mesh.nats_url, "KVMESH_FAULT_TOKEN_DELAY_S": "0.1"}
    env.pop("KVMESH_ALLOW_FAULT_INJECTION", None)
    process = subprocess.run([sys.executable, "-m", "services.decode"], env=env, capture_output=True, timeout=60)
    assert process.returncode != 0
    assert "KVMESH_FAULT_TOKEN_DELAY_S=0.1: fault injection is for tests" in process.stderr.decode()
