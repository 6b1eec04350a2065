"""free_port: ports for processes started later, chosen where the kernel's own choices (binds to port 0, outgoing
connections) cannot take them in the meantime, and never the same one twice in a process."""

from __future__ import annotations

import socket

from kvmesh.nats_server import _ephemeral_range, free_port


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
