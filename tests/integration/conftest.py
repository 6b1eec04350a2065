"""Whole meshes of real processes on loopback: `kvmesh up`'s own launcher, an embedded NATS, real gRPC."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.bench.otlp_sink import OTLPSink
from kvmesh.nats_server import free_port
from kvmesh.up import Child, Mesh, MeshPlan

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


def wait_child_ready(child: Child, timeout_s: float = 300) -> None:
    """Until `child` answers /readyz; raises at once if it exits first. The bound is roomy: a worker loads its
    model and warms up while the rest of the suite runs beside it (a loaded CI machine took over 120 s)."""

    def is_ready() -> bool:
        if child.process.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.process.returncode}) before it was ready")
        return ready(child.http_port)

    wait_until(is_ready, timeout_s, f"{child.name} ready")


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
        wait_until(lambda: all(ready(c.http_port) for c in mesh.children), 300, "every child ready")
        time.sleep(1.5)  # three heartbeats: every worker is in the balancer's pools
    except Exception as exc:
        mesh.stop()
        raise RuntimeError(f"mesh did not start; see {log_path}:\n" + log_path.read_text()[-4000:]) from exc
    return mesh


@pytest.fixture(scope="session")
def receiver() -> Iterator[OTLPSink]:
    """An OTLP receiver the session's mesh exports its spans to (test_tracing.py reads them)."""
    with OTLPSink() as running:
        yield running


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory, receiver: OTLPSink) -> Iterator[Mesh]:
    """Two prefill and two decode workers, two balancers, one KV store, serving SmolLM2 (real weights), exporting
    traces to `receiver`. One mesh for test_mesh.py and test_tracing.py (tests/scheduling.py deals them to one
    worker, in that order, and stop it when the second ends): a test that kills a worker starts it again unless it
    is the last to use the mesh."""
    log_path = tmp_path_factory.mktemp("mesh") / "mesh.log"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    mesh = start_mesh(log_path, env, prefill=2, decode=2, kvcache=1, balancer=2, models=("smollm2-135m",))
    mesh.log_path = log_path  # type: ignore[attr-defined]
    yield mesh
    mesh.stop()
