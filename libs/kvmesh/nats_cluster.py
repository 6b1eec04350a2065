"""A NATS cluster of embedded servers (kvmesh.nats_server) on one host, joined by routes, JetStream on every node:
what `kvmesh up --nats-cluster 3` starts, and what the leader-kill test runs the mesh on.

    cluster = NatsCluster(3).start()      # every node up and JetStream's meta leader elected (/healthz)
    cluster.address                       # nats://h:p1,nats://h:p2,nats://h:p3: a client fails over between them
    cluster.kill(cluster.meta_leader())   # SIGKILL one node (tests); cluster.restart(name) brings it back

Each node has a store directory of its own (node-<i>/ under one base) and they share one users file, so every node
has the same users with the same passwords and a node restarts on its own store. Routes authenticate with one user
made for this cluster. The mesh's streams and buckets are created with JetStream replicas = `replicas`
(KVMESH_JETSTREAM_REPLICAS, which `kvmesh up` sets): with 3, losing one node loses no acknowledged message, and the
Raft groups it led elect new leaders among the two left.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvmesh.nats_config import EMBEDDED_BCRYPT_ROUNDS, ClusterRoutes, ServerTLS, new_password
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh.bus_auth import NatsUser

MIN_SIZE = 3  # JetStream needs a majority left after a node is lost: 2 of 3
MAX_REPLICAS = 5  # JetStream's limit on a stream's replicas
ROUTE_USER = "kvmesh-route"


class NatsCluster:
    def __init__(
        self,
        size: int = 3,
        host: str = "127.0.0.1",
        store_dir: Path | None = None,
        *,
        workers: Iterable[tuple[str, str]] = (),
        insecure: bool | None = None,
        tls: ServerTLS | None = None,
        bcrypt_rounds: int = EMBEDDED_BCRYPT_ROUNDS,
    ) -> None:
        """`size` nodes on `host`; the other arguments are EmbeddedNats's, the same for every node."""
        if size < MIN_SIZE:
            raise ValueError(f"a NATS cluster needs at least {MIN_SIZE} nodes (--nats-cluster {size})")
        self._tmp = None if store_dir is not None else tempfile.TemporaryDirectory(prefix="kvmesh-nats-cluster-")
        self.store_dir = store_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.host = host
        route_user = NatsUser(ROUTE_USER, new_password())
        route_ports = [free_port(host) for _ in range(size)]
        workers = list(workers)
        self.nodes: list[EmbeddedNats] = []
        for index, route_port in enumerate(route_ports):
            peers = tuple((host, port) for port in route_ports if port != route_port)
            routes = ClusterRoutes(f"nats-{index}", host, route_port, peers, route_user)
            node_dir = self.store_dir / f"node-{index}"
            node_dir.mkdir(parents=True, exist_ok=True)
            node = EmbeddedNats(
                host,
                store_dir=node_dir,
                workers=workers,
                insecure=insecure,
                tls=tls,
                bcrypt_rounds=bcrypt_rounds,
                cluster=routes,
                users_file=self.store_dir / "kvmesh-users.json",
                monitor_port=free_port(host),
            )
            self.nodes.append(node)

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def replicas(self) -> int:
        """The JetStream replicas the mesh's streams and buckets should have on this cluster."""
        return min(self.size, MAX_REPLICAS)

    @property
    def insecure(self) -> bool:
        return self.nodes[0].insecure

    @property
    def address(self) -> str:
        """Every node's nats:// (or tls://) address, comma-separated, without credentials."""
        return ",".join(node.address for node in self.nodes)

    @property
    def url(self) -> str:
        """The administrator's URL of every node, comma-separated: what tests and tools connect with."""
        return ",".join(node.url for node in self.nodes)

    def url_as(self, role: str, worker_id: str | None = None) -> str:
        return ",".join(node.url_as(role, worker_id) for node in self.nodes)

    def write_creds(self, role: str, worker_id: str | None, path: Path) -> Path | None:
        return self.nodes[0].write_creds(role, worker_id, path)  # every node has the same users

    def node(self, server_name: str) -> EmbeddedNats:
        return next(node for node in self.nodes if node.cluster is not None and node.cluster.server_name == server_name)

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        """Start every node, then wait until each reports JetStream healthy (a meta leader elected, caught up)."""
        try:
            for node in self.nodes:
                node.start(timeout_s)
            deadline = time.monotonic() + timeout_s
            for node in self.nodes:
                wait_healthy(node, deadline)
        except Exception:
            self.stop()
            raise
        return self

    def kill(self, server_name: str) -> None:
        """SIGKILL one node (no goodbye to its peers or clients) and wait for it to exit."""
        process = self.node(server_name).process
        assert process is not None, f"{server_name} is not running"
        process.kill()
        process.wait()
        self.node(server_name).process = None

    def restart(self, server_name: str, timeout_s: float = 30.0) -> None:
        """Start a killed node again on its ports and store; it catches up from its peers."""
        node = self.node(server_name)
        node.start(timeout_s)
        wait_healthy(node, time.monotonic() + timeout_s)

    def live_nodes(self) -> list[EmbeddedNats]:
        return [node for node in self.nodes if node.process is not None and node.process.poll() is None]

    def meta_leader(self) -> str | None:
        """The server name of JetStream's meta leader, as the first live node that knows one reports it."""
        for node in self.live_nodes():
            meta = monitor(node, "jsz").get("meta_cluster", {})
            if meta.get("leader"):
                return str(meta["leader"])
        return None

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def monitor(node: EmbeddedNats, endpoint: str) -> dict[str, Any]:
    """One of a node's monitoring endpoints (jsz, varz, routez...) as JSON; {} when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{node.host}:{node.monitor_port}/{endpoint}", timeout=2) as response:
            return dict(json.loads(response.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def wait_healthy(node: EmbeddedNats, deadline: float) -> None:
    """Until the node's /healthz answers 200: JetStream on, a meta leader known, this node caught up with it."""
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{node.host}:{node.monitor_port}/healthz", timeout=2) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")[:200]
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    name = node.cluster.server_name if node.cluster is not None else node.address
    raise TimeoutError(f"NATS node {name} not healthy (JetStream) in time: {last}")
