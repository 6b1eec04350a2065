"""The bulk lane authenticated by mutual TLS and sealed, on real loopback sockets with throwaway certificates: a
prefill peer of the mesh's CA gets its exchange byte for byte (megabytes, pooled and reused); a peer without a
certificate, with one of another CA, with one of a role the lane does not take, or speaking plain TCP gets
nothing: no byte of an answer, the connection closed, and the refusal counted."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from mesh import lane
from mesh.config import LaneSettings
from mesh.lane_io import SealedSocket, role_of
from mesh.pb import kvcache_pb2

from .echo_lane import EchoLane, echo
from .lane_certs import Authority, client_context, issue, make_authority, server_context


@dataclass
class Mesh:
    authority: Authority
    directory: Path
    lane: EchoLane
    address: str

    def client(self, role: str | None, authority: Authority | None = None) -> ssl.SSLContext:
        identity = None if role is None else issue(authority or self.authority, self.directory, role)
        return client_context(self.authority, identity)


@pytest_asyncio.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    authority = make_authority(tmp_path)
    echo_lane = EchoLane(ssl_context=server_context(authority, issue(authority, tmp_path, "kvcache")))
    port = await echo_lane.start("127.0.0.1", 0)
    yield Mesh(authority, tmp_path, echo_lane, f"127.0.0.1:{port}")
    await echo_lane.stop()


@pytest.mark.parametrize("encrypt", [True, False])
async def test_a_prefill_peer_gets_its_exchange_byte_for_byte_and_the_connection_is_reused(
    mesh: Mesh, encrypt: bool
) -> None:
    mesh.lane.limits = LaneSettings(lane_encrypt=encrypt)  # the server's choice; the client follows it
    pool = lane.LanePool(ssl_context=mesh.client("prefill"))
    data = os.urandom(3 * 2**20 + 17)  # many TLS records, not a multiple of one
    async with pool.connection(mesh.address) as sock:
        assert isinstance(sock, SealedSocket) and sock.encrypt == encrypt
        assert role_of(sock.peer_cert) == "kvcache"
        assert await echo(sock, data, offset=1) == data
    assert pool.num_idle(mesh.address) == 1
    async with pool.connection(mesh.address) as again:
        assert again is sock
        assert await echo(again, b"small", offset=2) == b"small"
    pool.close()
    assert (mesh.lane.num_unauthorized, mesh.lane.num_refused) == (0, 0)


async def gets_nothing(address: str, context: ssl.SSLContext | None) -> bytes:
    """Connect (TLS when `context`), send a whole exchange, and return every plaintext byte the lane answers."""
    try:
        sock = await lane.connect(address, 5.0, context)
    except lane.LaneError:
        return b""  # refused within the handshake
    received = bytearray()
    try:
        await lane.send_frame(sock, kvcache_pb2.LaneFrame(block=kvcache_pb2.Block(offset=9)), [b"secret?"])
        async with asyncio.timeout(5.0):
            while True:
                chunk = bytearray(4096)
                try:
                    await lane.recv_exactly_into(sock, memoryview(chunk)[:1])
                except (lane.LaneError, OSError):
                    return bytes(received)  # closed: TLS alert, reset or EOF
                received += chunk[:1]
    finally:
        sock.close()


@pytest.mark.parametrize(
    "peer",
    ["no certificate", "another CA", "a decode certificate", "plain TCP"],
)
async def test_a_peer_the_lane_does_not_take_gets_nothing(mesh: Mesh, peer: str) -> None:
    if peer == "no certificate":
        context: ssl.SSLContext | None = mesh.client(None)
    elif peer == "another CA":
        context = mesh.client("prefill", authority=make_authority(mesh.directory / "other", "other CA"))
    elif peer == "a decode certificate":
        context = mesh.client("decode")
    else:
        context = None
    assert await gets_nothing(mesh.address, context) == b""
    await asyncio.sleep(0.05)  # the lane's task logs and closes after the client saw the close
    assert (mesh.lane.num_unauthorized, mesh.lane.num_connections) == (1, 0)
    # the lane still serves its peers
    pool = lane.LanePool(ssl_context=mesh.client("prefill"))
    async with pool.connection(mesh.address) as sock:
        assert await echo(sock, b"still here") == b"still here"
    pool.close()


async def test_a_peer_that_never_finishes_its_handshake_is_closed_at_the_deadline(tmp_path: Path) -> None:
    authority = make_authority(tmp_path)
    limits = LaneSettings(lane_handshake_timeout_s=0.3)
    echo_lane = EchoLane(limits, server_context(authority, issue(authority, tmp_path, "kvcache")))
    port = await echo_lane.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    silent = socket.create_connection(("127.0.0.1", port))
    silent.setblocking(False)
    async with asyncio.timeout(3.0):
        assert await loop.sock_recv(silent, 1) == b""  # closed, nothing sent
    silent.close()
    assert echo_lane.num_unauthorized == 1
    await echo_lane.stop()


def test_the_role_is_read_from_the_spiffe_uri_only() -> None:
    assert role_of({"subjectAltName": (("DNS", "kvmesh"), ("URI", "spiffe://kvmesh/prefill/p-1"))}) == "prefill"
    assert role_of({"subjectAltName": (("URI", "spiffe://other/prefill/p-1"),)}) is None
    assert role_of({"subjectAltName": (("URI", "spiffe://kvmesh/prefill"),)}) is None  # no instance
    assert role_of({"subject": ((("commonName", "prefill"),),)}) is None  # a bare name proves no role
    assert role_of(None) is None
