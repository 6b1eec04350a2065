"""Whole meshes of real processes on loopback: `kvmesh up`'s own launcher, an embedded NATS, real gRPC."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.nats_server import free_port
from kvmesh.up import Mesh, MeshPlan

API_KEY = "sk-kvmesh-test"


def scrape(port: int, metric: str) -> dict[str, float]:
    """Samples of one metric from a child's /metrics, keyed by their label string."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(rf"^{metric}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            samples[match.group(1) or ""] = float(match.group(2))
    return samples


def total(port: int, metric: str) -> float:
    return sum(scrape(port, metric).values())


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def start_mesh(log_path: Path, env_extra: dict[str, str] | None = None, **plan_args) -> Mesh:
    plan_args.setdefault("balancer", 1)  # kvmesh up runs two; one is enough where balancers are not under test
    plan = MeshPlan(
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=(API_KEY,),
        env={
            "KVMESH_HEARTBEAT_INTERVAL_S": "0.5",
            "KVMESH_LOG_FORMAT": "json",
            "KVMESH_KV_CACHE_MEMORY_BYTES": str(64 * 2**20),
            **(env_extra or {}),
        },
        **plan_args,
    )
    mesh = Mesh(plan, out=log_path.open("w"))
    mesh.start()
    try:
        mesh.wait_ready(timeout_s=300)
        wait_until(lambda: all(ready(c.http_port) for c in mesh.children), 120, "every child ready")
        time.sleep(1.5)  # three heartbeats: every worker is in the balancer's pools
    except Exception as exc:
        mesh.stop()
        raise RuntimeError(f"mesh did not start; see {log_path}:\n" + log_path.read_text()[-4000:]) from exc
    return mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Two prefill and two decode workers, two balancers, one KV store, serving SmolLM2 (real weights)."""
    log_path = tmp_path_factory.mktemp("mesh") / "mesh.log"
    mesh = start_mesh(log_path, prefill=2, decode=2, kvcache=1, balancer=2, models=("smollm2-135m",))
    yield mesh
    mesh.stop()
