"""`kvmesh up`'s embedded NATS speaks only TLS with client certificates of the mesh's CA: a real nats-server as
Mesh.start_nats() starts it, clients in plaintext or without a certificate refused, a child's own certificate
and user let in."""

from __future__ import annotations

import asyncio
import io
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.up import Mesh, MeshPlan
from mesh import subjects
from mesh.access import DECODE
from mesh.bus import Bus, BusError
from mesh.bus_auth import read_user
from mesh.config import TLSSettings
from mesh.pb import events_pb2
from mesh.tls import CA_FILE, client_ssl_context, load_credentials


@pytest.fixture
def throwaway(monkeypatch: pytest.MonkeyPatch) -> Iterator[Mesh]:
    """A mesh's NATS with the CA `kvmesh up` makes for its run (no KVMESH_TLS_DIR), and no children."""
    monkeypatch.delenv("KVMESH_TLS_DIR")
    mesh = Mesh(MeshPlan(), out=io.StringIO())
    mesh.certificates = mesh.throwaway_certificates()
    mesh.start_nats()
    yield mesh
    mesh.stop()


async def child_bus(mesh: Mesh, role: str, index: int) -> Bus:
    """Connect as child `<role>-<index>` would, from the environment `kvmesh up` gives it."""
    env = mesh.child_env(role, index, 0)
    credentials = load_credentials(role, TLSSettings(tls_dir=env["KVMESH_TLS_DIR"]))
    assert credentials is not None
    user = read_user(Path(env["KVMESH_NATS_CREDS"]))
    return await Bus.connect(env["KVMESH_NATS_URL"], f"{role}-{index}", 2.0, user, client_ssl_context(credentials))


async def test_children_and_tools_speak_tls_to_it(throwaway: Mesh) -> None:
    assert throwaway.nats is not None
    port = throwaway.nats.port
    assert throwaway.child_env(DECODE, 0, 0)["KVMESH_NATS_URL"] == f"tls://127.0.0.1:{port}"
    assert throwaway.nats_url.startswith("tls://kvmesh-admin:") and throwaway.nats_tls is not None
    tool = await Bus.connect(throwaway.nats_url, "tool", 2.0, tls=throwaway.nats_tls)
    heard: list[str] = []

    async def on_beat(beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        heard.append(subject)

    await tool.subscribe(subjects.heartbeat(DECODE), events_pb2.WorkerHeartbeat, on_beat)
    await tool.flush()
    decode = await child_bus(throwaway, DECODE, 0)
    await decode.publish(subjects.worker_heartbeat(DECODE, "decode-0"), events_pb2.WorkerHeartbeat())
    await decode.flush()
    for _ in range(50):
        if heard:
            break
        await asyncio.sleep(0.05)
    assert heard == ["kvmesh.workers.decode.decode-0"]
    await asyncio.gather(tool.close(), decode.close())


async def test_plaintext_and_certificateless_clients_are_refused(throwaway: Mesh) -> None:
    assert throwaway.nats is not None and throwaway.certificates is not None
    admin = throwaway.nats.grants["kvmesh-admin"].user  # even the administrator's password is not enough
    plaintext = f"nats://127.0.0.1:{throwaway.nats.port}"
    with pytest.raises(BusError, match="cannot reach NATS"):
        await Bus.connect(plaintext, "plaintext", 1.0, admin)
    ca_only = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca_only.check_hostname = False
    ca_only.load_verify_locations(throwaway.certificates.directory / "nats" / CA_FILE)
    with pytest.raises(BusError):
        await Bus.connect(throwaway.nats.address, "no-certificate", 1.0, admin, ca_only)


def test_own_certificates_serve_nats_from_their_nats_directory(mesh_certificates: Path) -> None:
    """KVMESH_TLS_DIR from `kvmesh certs init` (the suite's): NATS takes DIR/nats/; without it, no TLS."""
    mesh = Mesh(MeshPlan(), out=io.StringIO())
    assert mesh.throwaway_certificates() is None
    assert mesh.nats_certificate_dir(TLSSettings(tls_dir=str(mesh_certificates))) == mesh_certificates / "nats"
    assert mesh.nats_certificate_dir(TLSSettings(tls_dir=str(mesh_certificates / DECODE))) is None
    assert mesh.nats_certificate_dir(TLSSettings(insecure=True)) is None
