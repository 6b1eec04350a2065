"""What `kvmesh certs init` writes for NATS (compose, Kubernetes), run by a real nats-server: per-role credential
files (0600) whose passwords appear in the server's configuration only bcrypt-hashed, TLS with client
certificates of the mesh's CA, and the roles' permissions from mesh.bus_auth."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.certs import NATS_CONFIG, NATS_DIR, init_directory
from kvmesh.cli import main
from kvmesh.nats_config import MAX_PAYLOAD, MAX_PENDING
from kvmesh.nats_server import EmbeddedNats, free_port, nats_server_binary, wait_for_port
from mesh import subjects
from mesh.access import ROLES
from mesh.bus import Bus, BusError, load_user
from mesh.bus_auth import CREDS_FILE, read_user
from mesh.config import TLSSettings
from mesh.pb import events_pb2
from mesh.tls import client_ssl_context, load_credentials


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_directory(directory, workers=(("decode", "decode-0"), ("decode", "decode-1")))
    return directory


@pytest.fixture(scope="module")
def nats_port(certs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    store = tmp_path_factory.mktemp("store")
    config = certs_dir / NATS_DIR / NATS_CONFIG
    command = [str(nats_server_binary()), "-c", str(config), "-a", "127.0.0.1", "-p", str(port)]
    command += ["-js", "-sd", str(store)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 10, process)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_each_role_gets_a_private_credential_file_and_the_server_only_hashes(certs_dir: Path) -> None:
    config = (certs_dir / NATS_DIR / NATS_CONFIG).read_text()
    for role in ROLES:
        path = certs_dir / role / CREDS_FILE
        assert path.stat().st_mode & 0o777 == 0o600
        user = read_user(path)
        assert user.user == role and len(user.password) == 43  # 32 random bytes, URL-safe base64
        assert user.password not in config
        assert f'{{user: "{role}", password: "$2a$10$' in config
    assert f"max_payload: {MAX_PAYLOAD}\nmax_pending: {MAX_PENDING}\n" in config
    assert f'ca_file: "{certs_dir.absolute() / NATS_DIR / "ca.pem"}"' in config and "verify: true" in config
    assert (certs_dir / NATS_DIR / f"{NATS_DIR}-key.pem").stat().st_mode & 0o777 == 0o600


def test_a_role_finds_its_credentials_beside_its_certificate(certs_dir: Path, tmp_path: Path) -> None:
    env = {"KVMESH_TLS_DIR": str(certs_dir)}
    assert load_user("decode", env) == read_user(certs_dir / "decode" / CREDS_FILE)
    assert load_user("decode", {"KVMESH_TLS_DIR": str(certs_dir / "decode")}) == load_user("decode", env)
    explicit = read_user(certs_dir / "gateway" / CREDS_FILE).write(tmp_path / "other.creds")
    chosen = load_user("decode", {**env, "KVMESH_NATS_CREDS": str(explicit)})
    assert chosen is not None and chosen.user == "gateway"  # the setting wins
    assert load_user("decode", {"KVMESH_TLS_DIR": str(tmp_path)}) is None


async def connect_as(role: str, certs_dir: Path, port: int, scheme: str = "tls") -> Bus:
    """As a process with KVMESH_TLS_DIR=certs_dir (a role's or a named worker's directory) connects."""
    credentials = load_credentials(role, TLSSettings(tls_dir=str(certs_dir)))
    assert credentials is not None
    user = load_user(role, {"KVMESH_TLS_DIR": str(certs_dir)})
    return await Bus.connect(f"{scheme}://127.0.0.1:{port}", role, 2.0, user, client_ssl_context(credentials))


async def test_roles_speak_over_tls_as_their_users(certs_dir: Path, nats_port: int) -> None:
    balancer = await connect_as("balancer", certs_dir, nats_port)
    decode = await connect_as("decode", certs_dir, nats_port)
    heard: list[str] = []

    async def on_beat(beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        heard.append(subject)

    await balancer.subscribe(subjects.heartbeat("decode"), events_pb2.WorkerHeartbeat, on_beat)
    await balancer.flush()
    await decode.publish(subjects.worker_heartbeat("decode", "decode-abc"), events_pb2.WorkerHeartbeat())
    await decode.publish(subjects.worker_heartbeat("balancer", "decode-abc"), events_pb2.WorkerHeartbeat())
    # one connection's messages arrive in order: once this one is heard, everything before it has been
    await decode.publish(subjects.worker_heartbeat("decode", "decode-end"), events_pb2.WorkerHeartbeat())
    await decode.flush()
    async with asyncio.timeout(30):  # generous: a loaded CI machine once took over 10 s; the order is what counts
        while len(heard) < 2:
            await asyncio.sleep(0.02)
    assert heard == ["kvmesh.workers.decode.decode-abc", "kvmesh.workers.decode.decode-end"]
    await asyncio.gather(balancer.close(), decode.close())


async def test_no_client_certificate_or_no_tls_is_refused(certs_dir: Path, nats_port: int) -> None:
    user = load_user("decode", {"KVMESH_TLS_DIR": str(certs_dir)})
    ca_only = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca_only.check_hostname = False
    ca_only.load_verify_locations(certs_dir / "ca.pem")
    with pytest.raises(BusError):
        await Bus.connect(f"tls://127.0.0.1:{nats_port}", "no-cert", 1.0, user, ca_only)
    with pytest.raises(BusError):
        await Bus.connect(f"nats://127.0.0.1:{nats_port}", "plaintext", 1.0, user)


async def test_a_tls_url_never_talks_plaintext_to_a_server_without_tls(certs_dir: Path) -> None:
    credentials = load_credentials("decode", TLSSettings(tls_dir=str(certs_dir)))
    assert credentials is not None
    with (
        EmbeddedNats(insecure=False) as plaintext,  # users, but no TLS: what a downgrading middleman would offer
        pytest.raises(BusError, match="cannot reach NATS"),
    ):
        user, tls = plaintext.user("decode"), client_ssl_context(credentials)
        await Bus.connect(f"tls://127.0.0.1:{plaintext.port}", "decode", 1.0, user, tls)


async def test_a_named_worker_speaks_only_as_itself(certs_dir: Path, nats_port: int) -> None:
    """`certs init --worker decode/decode-0`: its own certificate and user, which may announce only decode-0; the
    role's shared user (compose replicas) may announce any decode worker."""
    credentials = load_credentials("decode", TLSSettings(tls_dir=str(certs_dir / "decode-0")))
    assert credentials is not None and credentials.identity.uri == "spiffe://kvmesh/decode/decode-0"
    assert read_user(certs_dir / "decode-0" / CREDS_FILE).user == "decode.decode-0"
    balancer = await connect_as("balancer", certs_dir, nats_port)
    heard: list[str] = []

    async def on_beat(beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        heard.append(subject)

    await balancer.subscribe(subjects.heartbeat("decode"), events_pb2.WorkerHeartbeat, on_beat)
    await balancer.flush()
    named, shared = (
        await connect_as("decode", certs_dir / "decode-0", nats_port),
        await connect_as("decode", certs_dir, nats_port),
    )
    for bus, worker_id in ((named, "decode-0"), (named, "decode-1"), (shared, "decode-7")):
        await bus.publish(subjects.worker_heartbeat("decode", worker_id), events_pb2.WorkerHeartbeat())
        await bus.flush()
    await asyncio.sleep(0.3)
    assert heard == ["kvmesh.workers.decode.decode-0", "kvmesh.workers.decode.decode-7"]
    await asyncio.gather(balancer.close(), named.close(), shared.close())


def test_certs_init_names_workers_or_says_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["certs", "init", str(tmp_path / "ok"), "--worker", "prefill/prefill-a"]) == 0
    assert (tmp_path / "ok" / "prefill-a" / "prefill.pem").is_file()
    assert read_user(tmp_path / "ok" / "prefill-a" / CREDS_FILE).user == "prefill.prefill-a"
    assert "KVMESH_TLS_DIR=" + str(tmp_path / "ok" / "prefill-a") in capsys.readouterr().err
    assert main(["certs", "init", str(tmp_path / "ok"), "--worker", "prefill/prefill-b"]) == 1  # needs --force
    for bad in ("nobody/x", "decode/a.b", "decode/>", "decode/decode", "decode/"):
        assert main(["certs", "init", str(tmp_path / "bad"), "--worker", bad]) == 2, bad
    assert not (tmp_path / "bad").exists()
    assert "--worker decode/a.b: NAME must be letters, digits" in capsys.readouterr().err
