"""The address a worker announces: what peers will dial, so it must be one they can reach."""

from __future__ import annotations

import socket

import pytest

from mesh.discovery import address_towards, advertise_host


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


def test_an_ipv6_address_comes_in_brackets():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.connect(("::1", 4222))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    assert advertise_host("::", "", "nats://[::1]:4222") == "[::1]"
