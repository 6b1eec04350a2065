"""`kvmesh up`: the whole mesh on one machine, every role a child process, NATS embedded.

    mesh = Mesh(MeshPlan(prefill=2, decode=2))
    mesh.start()            # NATS (unless a URL is given), then kvcache, balancer, encoder, prefill, decode, gateway
    mesh.wait_ready()       # the gateway's /readyz says a balancer and workers are live
    mesh.run_forever()      # restart children that die (kvmesh.supervisor); Ctrl-C stops everything cleanly
    mesh.stop()             # SIGTERM, then waits out each child's drain (KVMESH_DRAIN_TIMEOUT_S) before SIGKILL

Each child is `python -m kvmesh serve ROLE` configured through KVMESH_* variables; its output is prefixed
with its name. Nothing here knows a worker's address: workers announce themselves on NATS. Each child gets its
own certificate (`spiffe://kvmesh/<role>/<name>`) from a CA made for this run and gone with it, unless
KVMESH_TLS_* name certificates of your own or KVMESH_INSECURE=1 turns mutual TLS off, and its own NATS user
(KVMESH_NATS_CREDS), allowed only its role's subjects and its own heartbeat and KV event subjects (mesh.bus_auth).
The embedded NATS demands TLS with a client certificate of the same CA (tls://, the handshake first); tools and
tests connect as its administrator with `mesh.nats_url` and `mesh.nats_tls`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from engine_core import model_store
from kvmesh.certs import NATS_DIR, ProcessCertificates
from kvmesh.nats_cluster import MIN_SIZE as MIN_CLUSTER_SIZE
from kvmesh.nats_cluster import NatsCluster
from kvmesh.nats_config import ServerTLS
from kvmesh.nats_server import EmbeddedNats, free_port
from kvmesh.supervisor import Child, RestartPolicy, Supervisor
from mesh.config import ServiceSettings, SettingError, TLSSettings, load_settings
from mesh.tls import CA_FILE, client_ssl_context, load_credentials

STOP_MARGIN_S = 10.0  # past the drain timeout, for a drained child to close its servers and exit
START_ORDER = ("kvcache", "balancer", "expert_lb", "encoder", "prefill", "decode", "gateway")


@dataclass(frozen=True)
class MeshPlan:
    prefill: int = 1
    decode: int = 1
    kvcache: int = 1
    balancer: int = 2  # replicas sharing their decisions: one can die without a pause in routing
    gateway: int = 1  # processes sharing http_port and grpc_port (SO_REUSEPORT: the kernel spreads connections)
    encoder: int = 1  # vision encoder workers (0: the gateway refuses images)
    models: tuple[str, ...] = model_store.DEFAULT_MODELS
    http_port: int = 8080
    grpc_port: int = 50050
    nats_url: str | None = None  # None: start an embedded server
    nats_cluster: int = 1  # nodes of the embedded NATS: 1 server, or a cluster of 3 or more (JetStream replicas 3)
    api_keys: tuple[str, ...] = ()  # empty: generate a development key
    env: dict[str, str] = field(default_factory=dict)  # extra KVMESH_* settings for every child

    def __post_init__(self) -> None:
        for role in ("prefill", "decode", "kvcache", "balancer", "encoder"):
            if getattr(self, role) < 0:
                raise ValueError(f"--{role} must not be negative")
        if self.prefill < 1 or self.decode < 1 or self.balancer < 1 or self.gateway < 1:
            raise ValueError("a mesh needs at least one prefill, one decode, one balancer and one gateway")
        if self.nats_cluster != 1 and self.nats_cluster < MIN_CLUSTER_SIZE:
            raise ValueError(f"--nats-cluster must be 1 (one server) or at least {MIN_CLUSTER_SIZE}")
        if self.nats_cluster > 1 and self.nats_url:
            raise ValueError("--nats-cluster starts an embedded cluster: it cannot go with --nats URL")


class Mesh:
    def __init__(self, plan: MeshPlan, out: IO[str] | None = None) -> None:
        self.plan = plan
        self.out = out or sys.stderr
        self.api_keys = plan.api_keys or (
            os.environ.get("KVMESH_API_KEYS", "") and tuple(os.environ["KVMESH_API_KEYS"].split(","))
        )
        self.generated_key = None
        if not self.api_keys:
            self.generated_key = "sk-kvmesh-dev-" + secrets.token_urlsafe(18)
            self.api_keys = (self.generated_key,)
        # the key of /admin/v1/ (tenants, keys, prices): KVMESH_ADMIN_KEY, or one made for this run
        self.is_admin_key_generated = not os.environ.get("KVMESH_ADMIN_KEY")
        self.admin_key = os.environ.get("KVMESH_ADMIN_KEY") or "sk-kvmesh-admin-" + secrets.token_urlsafe(18)
        self.nats: EmbeddedNats | NatsCluster | None = None
        self.nats_url = plan.nats_url or ""
        self.nats_host = "127.0.0.1"  # where the embedded NATS listens (kvmesh.netns: the bridge's address)
        self.nats_tls: ssl.SSLContext | None = None  # with nats_url, for tools and tests: the embedded NATS's TLS
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self.certificates: ProcessCertificates | None = None  # this run's throwaway CA, made by start()
        self.supervisor: Supervisor | None = None  # restarts children that die (supervise(); kvmesh up always)
        self.is_stopping = False  # stop() began: an exit is expected, not a crash

    @property
    def gateway_host(self) -> str:
        """Where the gateway serves (kvmesh.netns: its host's address)."""
        return "127.0.0.1"

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway_host}:{self.plan.http_port}"

    def child_host(self, name: str) -> str:
        """The address child `name` binds and announces, where its /metrics and /readyz are (kvmesh.netns: its
        host's)."""
        return "127.0.0.1"

    def child_command(self, role: str, index: int) -> list[str]:
        """The command line of child `<role>-<index>` (kvmesh.netns runs it inside its host's namespace)."""
        return [sys.executable, "-m", "kvmesh", "serve", role]

    def start(self) -> None:
        self.certificates = self.throwaway_certificates()
        if not self.nats_url:
            self.start_nats()
        for role in START_ORDER:
            for index in range(self._count(role)):
                self.spawn(role, index)

    def start_nats(self) -> None:
        """The embedded NATS: a user per child, and TLS with client certificates of the mesh's CA (none under
        KVMESH_INSECURE=1; with certificates of your own, where `kvmesh certs init` wrote NATS's in DIR/nats/)."""
        settings = load_settings(TLSSettings, {**os.environ, **self.plan.env})
        nats_dir = self.nats_certificate_dir(settings)
        tls = None
        if nats_dir is not None:
            tls = ServerTLS(nats_dir / f"{NATS_DIR}.pem", nats_dir / f"{NATS_DIR}-key.pem", nats_dir / CA_FILE)
            credentials = load_credentials(NATS_DIR, TLSSettings(tls_dir=str(nats_dir)))
            assert credentials is not None
            self.nats_tls = client_ssl_context(credentials)  # the server's own certificate: it may act as a client
        workers, insecure = self.planned_workers(), settings.insecure
        if self.plan.nats_cluster > 1:
            size = self.plan.nats_cluster
            self.nats = NatsCluster(size, self.nats_host, workers=workers, insecure=insecure, tls=tls).start()
        else:
            self.nats = EmbeddedNats(self.nats_host, workers=workers, insecure=insecure, tls=tls).start()
        self.nats_url = self.nats.url  # the administrator's, for tools and tests; each child gets its own user
        users = "no users (KVMESH_INSECURE=1)" if settings.insecure else "a user per worker"
        security = "TLS with client certificates" if tls is not None else "no TLS"
        shape = f"cluster of {self.plan.nats_cluster}" if self.plan.nats_cluster > 1 else "server"
        self.say(f"nats: embedded {shape} at {self.nats.address} (JetStream on, {users}, {security})")

    def nats_certificate_dir(self, settings: TLSSettings) -> Path | None:
        """Where the embedded NATS's certificate is (ca.pem, nats.pem, nats-key.pem), or None: no TLS."""
        if settings.insecure:
            return None
        if self.certificates is not None:
            return self.certificates.issue(NATS_DIR, NATS_DIR)
        own = Path(settings.tls_dir).expanduser() / NATS_DIR if settings.tls_dir else None
        if own is not None and (own / f"{NATS_DIR}.pem").is_file():
            return own
        self.say("nats: no certificate for NATS among your own (KVMESH_TLS_DIR/nats/ from kvmesh certs init): no TLS")
        return None

    def throwaway_certificates(self) -> ProcessCertificates | None:
        """A CA for this run (None where KVMESH_TLS_* name the user's certificates: the children use those)."""
        settings = load_settings(TLSSettings, {**os.environ, **self.plan.env})
        if settings.tls_dir or settings.tls_cert:
            return None
        directory = Path(tempfile.mkdtemp(prefix="kvmesh-up-certs-"))
        self.say(f"certs: {'none (KVMESH_INSECURE=1)' if settings.insecure else 'a throwaway CA in ' + str(directory)}")
        return ProcessCertificates(directory, {**os.environ, **self.plan.env})

    def planned_workers(self) -> list[tuple[str, str]]:
        """(role, worker id) of every child start() spawns: each gets a NATS user of its own."""
        return [(role, f"{role}-{index}") for role in START_ORDER for index in range(self._count(role))]

    def _count(self, role: str) -> int:
        if role == "expert_lb":  # only when the workers report expert loads (KVMESH_EXPERT_REPORT_STEPS > 0)
            steps = self.plan.env.get("KVMESH_EXPERT_REPORT_STEPS", os.environ.get("KVMESH_EXPERT_REPORT_STEPS", "0"))
            return 1 if steps.strip().isdigit() and int(steps) > 0 else 0
        return int(getattr(self.plan, role))

    def child_env(self, role: str, index: int, http_port: int, grpc_port: int = 0) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        env.update({k: v for k, v in os.environ.items() if k.startswith("KVMESH_")})  # the user's settings pass through
        if isinstance(self.nats, NatsCluster):  # every stream and bucket on 3 nodes, unless the user says otherwise
            env.setdefault("KVMESH_JETSTREAM_REPLICAS", str(self.nats.replicas))
        env.update(self.plan.env)
        env.update(
            {
                "KVMESH_NATS_URL": self.nats.address if self.nats is not None else self.nats_url,
                "KVMESH_WORKER_ID": f"{role}-{index}",
                "KVMESH_MODELS": ",".join(self.plan.models),
                "KVMESH_API_KEYS": ",".join(self.api_keys),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env["KVMESH_HTTP_PORT"] = str(http_port)
        if self.certificates is not None:
            env.update(self.certificates.env(role, f"{role}-{index}"))
        if self.nats is not None:  # its own NATS user (the role's shared one for a worker start() did not plan)
            name = f"{role}-{index}"
            creds = self.nats.write_creds(role, name, self.nats.store_dir / "creds" / f"{name}.creds")
            env["KVMESH_NATS_CREDS"] = str(creds or "")
        if role == "gateway":
            env["KVMESH_ADMIN_KEY"] = self.admin_key
        # a worker's gRPC port is announced, so any would do; one kept across its restarts lets peers' channels
        # reconnect to the new process
        env["KVMESH_GRPC_PORT"] = str(grpc_port)
        if role == "gateway" and self.plan.gateway > 1:  # the replicas share the gateway's ports
            env["KVMESH_REUSE_PORT"] = "1"
        return env

    def spawn(self, role: str, index: int, env: dict[str, str] | None = None) -> Child:
        """Start one child; `env`: settings of its own over the plan's (a canary's KVMESH_VERSION, say)."""
        is_gateway = role == "gateway"
        http_port = self.plan.http_port if is_gateway else free_port()
        grpc_port = self.plan.grpc_port if is_gateway else free_port()
        child = Child(
            f"{role}-{index}",
            role,
            index,
            self._popen(role, index, http_port, grpc_port, env or {}),
            http_port,
            grpc_port,
            dict(env or {}),
        )
        self._start_pump(child, child.process)
        with self._lock:
            self.children = [c for c in self.children if c.name != child.name] + [child]
        return child

    def restart(self, child: Child) -> Child:
        """Start a dead child again: the same name, worker id, ports and settings (the supervisor calls it)."""
        assert child.process.poll() is not None, f"{child.name} is still running"
        process = self._popen(child.role, child.index, child.http_port, child.grpc_port, child.env)
        with self._lock:
            child.process = process
            child.num_restarts += 1
            child.started_at = time.monotonic()
            child.reported = False
        self._start_pump(child, process)
        return child

    def _popen(self, role: str, index: int, http_port: int, grpc_port: int, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            self.child_command(role, index),
            env=self.child_env(role, index, http_port, grpc_port) | env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def _start_pump(self, child: Child, process: subprocess.Popen) -> None:
        child.pump = threading.Thread(target=self._pump, args=(child, process), daemon=True)
        child.pump.start()

    def _pump(self, child: Child, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            child.last_lines.append(line.rstrip())
            self.say(f"{child.name:>11} | {line.rstrip()}")

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the gateway reports a balancer and workers live (raises if a child dies or time runs out)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.dead_children()
            if dead:
                for child in dead:  # its output to the end
                    if child.pump is not None:
                        child.pump.join(timeout=5)
                names = ", ".join(f"{c.name} (exit {c.process.returncode})" for c in dead)
                tails = "".join(f"\n--- the end of {c.name}'s output:\n{c.output_tail()}" for c in dead)
                raise RuntimeError(f"mesh failed to start: {names} exited{tails}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/readyz", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the mesh was not ready after {timeout_s:.0f}s")

    def dead_children(self) -> list[Child]:
        with self._lock:
            return [c for c in self.children if c.process.poll() is not None]

    def supervise(self, policy: RestartPolicy | None = None) -> Supervisor:
        """Restart children that die from now on (until stop()); `kvmesh up` does it for its whole run."""
        assert self.supervisor is None, "already supervised"
        self.supervisor = Supervisor(self, policy).start()
        return self.supervisor

    def restart_counts(self) -> dict[str, int]:
        """Restarts so far of each child restarted at least once."""
        with self._lock:
            return {c.name: c.num_restarts for c in self.children if c.num_restarts}

    def run_forever(self, policy: RestartPolicy | None = None) -> None:
        """Supervise the children until SIGINT or SIGTERM."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.supervise(policy)
        while not stop.wait(1.0):  # a timed wait: the signal handlers run between waits
            pass

    def child(self, name: str) -> Child:
        with self._lock:
            return next(c for c in self.children if c.name == name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one child and wait for it to exit (fault tests)."""
        process = self.child(name).process  # read once: a supervisor may restart the child right after it exits
        process.send_signal(sig)
        process.wait(timeout=60)

    def drain_timeout_s(self) -> float:
        """The longest KVMESH_DRAIN_TIMEOUT_S among the children (each may have its own)."""
        base = {**os.environ, **self.plan.env}
        with self._lock:
            envs = [base | child.env for child in self.children] or [base]
        timeouts: list[float] = []
        for env in envs:
            with contextlib.suppress(SettingError):  # a child that refused its settings at start drains nothing
                timeouts.append(load_settings(ServiceSettings, env).drain_timeout_s)
        return max(timeouts, default=ServiceSettings.drain_timeout_s)

    def stop(self, grace_s: float | None = None) -> None:
        """Gateway first (no new requests), then workers, then the rest; SIGKILL what outlives the grace: by
        default each child's drain timeout and STOP_MARGIN_S to close, never less (a long stream finishes)."""
        self.is_stopping = True
        if self.supervisor is not None:
            self.supervisor.stop()
        if grace_s is None:
            grace_s = self.drain_timeout_s() + STOP_MARGIN_S
        for role in reversed(START_ORDER):
            for child in self.children:
                if child.role == role and child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"kvmesh: {child.name} did not stop in {grace_s:.0f} s; killing it")
                child.process.kill()
                child.process.wait()
        counts = self.restart_counts()
        if counts:
            self.say("kvmesh: restarts during this run: " + ", ".join(f"{n} {k}" for n, k in counts.items()))
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.certificates is not None:
            shutil.rmtree(self.certificates.directory, ignore_errors=True)
            self.certificates = None
