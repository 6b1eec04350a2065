"""free_port: ports for processes started later, chosen where the kernel's own choices (binds to port 0, outgoing
connections) cannot take them in the meantime, and never the same one twice on the machine while it is claimed."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from kvmesh.nats_server import RESERVATION_S, _ephemeral_range, claim, free_port, reservation_dir


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    assert all(1024 <= port < low for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # still free
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        kernel_choice = taken.getsockname()[1]
        assert kernel_choice >= low and kernel_choice not in ports  # what a bind to 0 gets is elsewhere


def test_a_claimed_port_is_refused_to_others_until_its_claim_is_stale(tmp_path: Path) -> None:
    """The claim is what keeps two processes (parallel meshes, test workers) from handing out one port."""
    assert claim(20000, tmp_path) is True
    assert claim(20000, tmp_path) is False  # another process asking: taken
    claimed_at = (tmp_path / "20000").stat().st_mtime
    assert claim(20000, tmp_path, now=claimed_at + RESERVATION_S - 1) is False
    assert claim(20000, tmp_path, now=claimed_at + RESERVATION_S + 1) is True  # stale: taken over
    assert claim(20000, tmp_path) is False  # and the new claim holds
    assert claim(20001, tmp_path) is True


def test_ports_from_two_processes_never_coincide() -> None:
    """Two interpreters choose 200 ports each from the same range at the same time: none in common."""
    script = "from kvmesh.nats_server import free_port; print(' '.join(str(free_port()) for _ in range(200)))"
    children = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    first, second = (set(map(int, child.communicate(timeout=120)[0].split())) for child in children)
    assert len(first) == len(second) == 200
    assert first.isdisjoint(second)
    assert all((reservation_dir() / str(port)).is_file() for port in first | second)
