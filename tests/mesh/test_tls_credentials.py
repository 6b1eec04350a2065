"""Where a process's certificates come from and what happens without them: `kvmesh certs init DIR` makes a CA and
one per role, `kvmesh up` one per child from a throwaway CA; a process without certificates refuses to start
saying how to get them; KVMESH_INSECURE=1 runs plaintext and logs a warning; the stdlib contexts the lanes use
authenticate both ends by the same CA."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from kvmesh.certs import CertificateAuthority
from kvmesh.cli import main
from kvmesh.nats_server import EmbeddedNats, free_port
from kvmesh.up import Mesh, MeshPlan
from mesh import tls
from mesh.access import DECODE, GATEWAY, KVCACHE, PREFILL, ROLES
from mesh.config import SettingError, TLSSettings


def test_certs_init_makes_a_ca_and_one_certificate_per_role(tmp_path: Path) -> None:
    assert main(["certs", "init", str(tmp_path / "certs")]) == 0
    directory = tmp_path / "certs"
    for role in ROLES:
        credentials = tls.load_credentials(role, TLSSettings(tls_dir=str(directory)))
        assert credentials is not None
        assert credentials.identity == tls.PeerIdentity(role, role)
        assert credentials.cert_path == directory / role / f"{role}.pem"
        assert stat.S_IMODE(credentials.key_path.stat().st_mode) == 0o600
        assert credentials.ca_pem == (directory / "ca.pem").read_bytes()  # one CA for every role
        certificate = x509.load_pem_x509_certificate(credentials.cert_pem)
        lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
        assert lifetime == datetime.timedelta(days=365, minutes=5)
        assert certificate.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    ca = (directory / "ca.pem").read_bytes()
    assert not list(directory.rglob("ca-key.pem"))  # the CA's key is never written
    assert main(["certs", "init", str(directory)]) == 0  # already there: left alone
    assert (directory / "ca.pem").read_bytes() == ca
    assert main(["certs", "init", str(directory), "--force"]) == 0
    assert (directory / "ca.pem").read_bytes() != ca


def test_without_certificates_a_process_is_told_how_to_get_them(tmp_path: Path) -> None:
    with pytest.raises(tls.CertificateError) as nothing:
        tls.load_credentials(DECODE, TLSSettings())
    assert str(nothing.value) == f"decode: no certificates for the mesh's internal gRPC: {tls.HOW_TO_GET_CERTIFICATES}"
    assert "kvmesh certs init DIR" in str(nothing.value) and "KVMESH_INSECURE=1" in str(nothing.value)
    with pytest.raises(tls.CertificateError) as missing:
        tls.load_credentials(DECODE, TLSSettings(tls_dir=str(tmp_path)))
    assert str(missing.value).startswith(f"decode: missing {tmp_path / 'ca.pem'}, {tmp_path / 'decode.pem'}, ")
    with pytest.raises(SettingError, match="KVMESH_TLS_KEY"):
        TLSSettings(tls_key="key.pem")  # explicit paths come in threes


def test_a_certificate_of_another_role_or_out_of_date_is_refused(tmp_path: Path) -> None:
    authority = CertificateAuthority.create()
    authority.write(tmp_path / "decode", tls.PeerIdentity(PREFILL, "prefill-0"))
    (tmp_path / "decode" / "decode.pem").write_bytes((tmp_path / "decode" / "prefill.pem").read_bytes())
    (tmp_path / "decode" / "decode-key.pem").write_bytes((tmp_path / "decode" / "prefill-key.pem").read_bytes())
    with pytest.raises(tls.CertificateError) as other_role:
        tls.load_credentials(DECODE, TLSSettings(tls_dir=str(tmp_path)))
    path = tmp_path / "decode" / "decode.pem"
    assert str(other_role.value) == f"{path}: names spiffe://kvmesh/prefill/prefill-0, but this process is a decode"
    expired = authority.certificate.not_valid_before_utc - datetime.timedelta(days=1)
    old = x509.load_pem_x509_certificate(path.read_bytes())
    builder = (
        x509.CertificateBuilder()
        .subject_name(old.subject)
        .issuer_name(old.issuer)
        .public_key(old.public_key())  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(expired - datetime.timedelta(days=2))
        .not_valid_after(expired)
        .add_extension(old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, critical=False)
    )
    path.write_bytes(builder.sign(authority.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    with pytest.raises(tls.CertificateError, match="not now"):
        tls.load_credentials(PREFILL, TLSSettings(tls_cert=str(path), tls_key=str(path), tls_ca=str(path)))


def serve_balancer(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "serve", "balancer"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def role_env(nats_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_TLS_") and k != "KVMESH_INSECURE"}
    return {
        **env,
        "KVMESH_NATS_URL": nats_url,
        "KVMESH_HTTP_PORT": str(free_port()),
        "KVMESH_LOG_FORMAT": "json",
        "KVMESH_WORKER_ID": "balancer-tls",
        **extra,
    }


def test_a_role_without_certificates_refuses_to_start() -> None:
    process = serve_balancer(role_env("nats://127.0.0.1:1"))  # it never gets as far as NATS
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2
    assert output.strip().splitlines()[-1] == (
        f"kvmesh: error: balancer: no certificates for the mesh's internal gRPC: {tls.HOW_TO_GET_CERTIFICATES}"
    )


def test_insecure_mode_logs_a_warning_at_start_and_serves() -> None:
    with EmbeddedNats() as nats:
        process = serve_balancer(role_env(nats.url, KVMESH_INSECURE="1"))
        try:
            assert process.stdout is not None
            lines: list[dict[str, str]] = []
            deadline = time.monotonic() + 60
            while not any(line.get("event") == "serving" for line in lines) and time.monotonic() < deadline:
                text = process.stdout.readline()
                assert text, f"the balancer exited: {lines}"
                if text.startswith("{"):
                    lines.append(json.loads(text))
        finally:
            process.terminate()
            process.wait(30)
    warnings = [line for line in lines if line["level"] == "warning" and "KVMESH_INSECURE" in line["event"]]
    assert [line["event"] for line in warnings] == [
        "KVMESH_INSECURE is set: internal gRPC is plaintext and any peer may call any method"
    ]
    assert lines[-1]["event"] == "serving"


def test_kvmesh_up_gives_each_child_its_own_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVMESH_TLS_DIR", "KVMESH_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    mesh = Mesh(MeshPlan(prefill=2), out=io.StringIO())
    mesh.certificates = mesh.throwaway_certificates()
    assert mesh.certificates is not None
    try:
        identities = {}
        for role, index in ((PREFILL, 0), (PREFILL, 1), (GATEWAY, 0), (KVCACHE, 0)):
            env = mesh.child_env(role, index, 0)
            credentials = tls.load_credentials(role, TLSSettings(tls_dir=env["KVMESH_TLS_DIR"]))
            assert credentials is not None
            identities[f"{role}-{index}"] = credentials.identity.uri
            assert credentials.ca_pem == mesh.certificates.authority.pem
    finally:
        directory = mesh.certificates.directory
        mesh.stop()
    assert identities == {
        "prefill-0": "spiffe://kvmesh/prefill/prefill-0",
        "prefill-1": "spiffe://kvmesh/prefill/prefill-1",
        "gateway-0": "spiffe://kvmesh/gateway/gateway-0",
        "kvcache-0": "spiffe://kvmesh/kvcache/kvcache-0",
    }
    assert not directory.exists()  # the throwaway CA's files go with the mesh


def test_kvmesh_up_passes_the_users_certificates_or_insecure_on(monkeypatch: pytest.MonkeyPatch) -> None:
    own = Mesh(MeshPlan(), out=io.StringIO())
    assert own.throwaway_certificates() is None  # KVMESH_TLS_DIR is set (tests/conftest.py): children use it
    assert own.child_env(DECODE, 0, 0)["KVMESH_TLS_DIR"] == os.environ["KVMESH_TLS_DIR"]
    monkeypatch.delenv("KVMESH_TLS_DIR")
    insecure = Mesh(MeshPlan(env={"KVMESH_INSECURE": "1"}), out=io.StringIO())
    insecure.certificates = insecure.throwaway_certificates()
    try:
        env = insecure.child_env(DECODE, 0, 0)
        assert env["KVMESH_INSECURE"] == "1" and "KVMESH_TLS_DIR" not in env
        assert insecure.certificates is not None and not list(insecure.certificates.directory.iterdir())
    finally:
        insecure.stop()


async def test_the_lane_contexts_authenticate_both_ends_by_the_mesh_ca(tmp_path: Path) -> None:
    store, client = tls.load_credentials(KVCACHE), tls.load_credentials(PREFILL)
    assert store is not None and client is not None
    seen: list[tls.PeerIdentity | None] = []

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(tls.peer_identity_of_ssl(writer.get_extra_info("ssl_object")))
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0, ssl=tls.server_ssl_context(store))
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls.client_ssl_context(client))
        server_identity = tls.peer_identity_of_ssl(writer.get_extra_info("ssl_object"))
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        writer.close()
        CertificateAuthority.create("another CA").write(tmp_path, tls.PeerIdentity(PREFILL, "impostor"))
        impostor = tls.load_credentials(PREFILL, TLSSettings(tls_dir=str(tmp_path)))
        assert impostor is not None
        with pytest.raises(OSError):  # ssl.SSLError: the server's certificate is of a CA it does not trust
            await asyncio.open_connection("127.0.0.1", port, ssl=tls.client_ssl_context(impostor))
    finally:
        server.close()
        await server.wait_closed()
    assert server_identity == tls.PeerIdentity(KVCACHE, KVCACHE)
    assert seen == [tls.PeerIdentity(PREFILL, PREFILL)]
