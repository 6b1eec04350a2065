"""`kvmesh up`'s supervisor with real children: a balancer SIGKILLed comes back under its name, worker id and
ports; a child that cannot start is retried with backoff, then left down as a crash loop, with a message."""

from __future__ import annotations

import io
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.nats_server import free_port
from kvmesh.supervisor import RestartPolicy
from kvmesh.up import Mesh, MeshPlan


def test_the_delay_doubles_from_one_second_up_to_its_cap() -> None:
    policy = RestartPolicy()
    assert [policy.delay_s(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    with pytest.raises(ValueError):
        RestartPolicy(first_delay_s=0)
    with pytest.raises(ValueError):
        RestartPolicy(max_crashes=0)


def test_stop_waits_out_the_longest_drain_timeout_among_the_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_DRAIN_TIMEOUT_S", raising=False)
    assert Mesh(MeshPlan()).drain_timeout_s() == 30.0  # the setting's default; stop() adds 10 s to close
    assert Mesh(MeshPlan(env={"KVMESH_DRAIN_TIMEOUT_S": "45"})).drain_timeout_s() == 45.0


def is_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_until(condition, timeout_s: float, what: str, out: io.StringIO) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout_s:.0f}s waiting for {what}; the mesh said:\n" + out.getvalue()[-4000:]
            )
        time.sleep(0.1)


@pytest.fixture
def mesh() -> Iterator[tuple[Mesh, io.StringIO]]:
    """The embedded NATS of `kvmesh up` and no children yet."""
    out = io.StringIO()
    mesh = Mesh(MeshPlan(http_port=free_port(), grpc_port=free_port(), api_keys=("sk-test",)), out=out)
    mesh.certificates = mesh.throwaway_certificates()
    mesh.start_nats()
    yield mesh, out
    mesh.stop()


def test_a_killed_child_comes_back_as_itself_and_a_crash_loop_stays_down(mesh: tuple[Mesh, io.StringIO]) -> None:
    mesh, out = mesh
    policy = RestartPolicy(first_delay_s=0.2, max_delay_s=0.4, max_crashes=3, window_s=60.0, poll_s=0.05)
    balancer = mesh.spawn("balancer", 0)
    broken = mesh.spawn("balancer", 1, env={"KVMESH_LOG_LEVEL": "loud"})  # refused at start: exit code 2
    supervisor = mesh.supervise(policy)
    wait_until(lambda: is_ready(balancer.http_port), 300, "balancer-0 ready", out)
    first_pid, http_port, grpc_port = balancer.process.pid, balancer.http_port, balancer.grpc_port
    assert accepts(grpc_port)

    mesh.kill("balancer-0", signal.SIGKILL)
    wait_until(lambda: balancer.process.pid != first_pid, 30, "balancer-0 restarted", out)
    assert (mesh.child("balancer-0"), balancer.num_restarts) == (balancer, 1)
    wait_until(lambda: is_ready(http_port), 300, "balancer-0 ready again", out)  # the same status port
    assert accepts(grpc_port) and balancer.grpc_port == grpc_port  # the same gRPC port: peers' channels reconnect
    environ = Path(f"/proc/{balancer.process.pid}/environ").read_bytes().split(b"\0")
    assert b"KVMESH_WORKER_ID=balancer-0" in environ

    wait_until(lambda: supervisor.given_up() == ["balancer-1"], 300, "balancer-1's crash loop to be noticed", out)
    assert broken.num_restarts == 2 and broken.process.returncode == 2
    lines = [line for line in out.getvalue().splitlines() if line.startswith("kvmesh: ")]
    assert [line for line in lines if "balancer-0" in line] == [
        "kvmesh: balancer-0 exited with code -9; restarting it in 0.2 s (restart 1)",
        f"kvmesh: balancer-0 restarted (pid {balancer.process.pid}, restart 1)",
    ]
    assert [line.split(" (pid")[0] for line in lines if "balancer-1" in line] == [
        "kvmesh: balancer-1 exited with code 2; restarting it in 0.2 s (restart 1)",
        "kvmesh: balancer-1 restarted",
        "kvmesh: balancer-1 exited with code 2; restarting it in 0.4 s (restart 2)",
        "kvmesh: balancer-1 restarted",
        "kvmesh: balancer-1 exited with code 2: 3 exits within 60 s, a crash loop, so it stays down (its output "
        "above says why; restart kvmesh up once it is fixed)",
    ]
    assert mesh.restart_counts() == {"balancer-0": 1, "balancer-1": 2}


def test_a_child_that_cannot_start_fails_the_wait_with_its_own_words(mesh: tuple[Mesh, io.StringIO]) -> None:
    """wait_ready's error quotes the dead child's last output, so a failed start says why where it is reported
    (a benchmark's mesh log is a temporary file; the error is what a test or CI prints)."""
    mesh, _ = mesh
    mesh.spawn("balancer", 0, env={"KVMESH_LOG_LEVEL": "loud"})
    with pytest.raises(RuntimeError) as failure:
        mesh.wait_ready(timeout_s=120)
    assert str(failure.value) == (
        "mesh failed to start: balancer-0 (exit 2) exited\n"
        "--- the end of balancer-0's output:\n"
        "kvmesh: error: KVMESH_LOG_LEVEL='loud': must be debug, info, warning or error"
    )
