"""Real hosts on one machine: every role of a mesh in a Linux network namespace of its own, each namespace joined to
one bridge by a veth pair and given its own IPv4 address; nothing travels over loopback. NATS (and whoever drives
the mesh: a test, `make netns-up`) stays in the root namespace on the bridge's own address.

    with Hosts() as hosts:                              # a bridge and a /24 of its own; removed on exit
        mesh = NetnsMesh(hosts, MeshPlan(...))          # each child runs under `ip netns exec <its host>`
        mesh.start(); mesh.wait_ready()                 # the gateway serves on its host's address
        hosts.impair("prefill-0", "decode-0", delay_ms=2, loss_pct=0.1)   # tc netem, both ways

Names are unique per run (`kvm<6 hex>-...`), so runs side by side do not collide, and `close()` removes every
namespace and the bridge even after a failure (deleting a namespace deletes its end of the veth pair, and with it
the pair). Needs root and iproute2 (`ip`, `tc`); `unavailable()` says why not, for a caller that skips.

Each child gets KVMESH_HOST = its host's address: it binds there and announces it (mesh.discovery), so every peer
dials a reachable address on the bridge, and the bulk lanes (prefill to decode, prefill to the KV store) cross it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass

from kvmesh.up import Mesh, MeshPlan

IP = "ip"
TC = "tc"
IPTABLES = "iptables"
DEVICE = "eth0"  # the namespace's end of its veth pair


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made: the command and what it said."""


def run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(command)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can): not root, no iproute2, or the kernel refuses."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in (IP, TC) if shutil.which(tool) is None]
    if missing:
        return f"iproute2 is not installed (no {' or '.join(missing)})"
    probe = f"kvmprobe{secrets.token_hex(3)}"
    try:
        run(IP, "netns", "add", probe)
    except NetnsError as exc:
        return f"this kernel or container refuses network namespaces: {exc}"
    with contextlib.suppress(NetnsError):
        run(IP, "netns", "del", probe)
    return None


def netem_unavailable() -> str | None:
    """Why `Hosts.impair` cannot work here (None: it can): the kernel has no netem or prio qdisc (some VM kernels
    are built without CONFIG_NET_SCH_NETEM or CONFIG_NET_SCH_PRIO, and a container cannot load modules)."""
    reason = unavailable()
    if reason is not None:
        return reason
    probe = f"kvmprobe{secrets.token_hex(3)}"
    run(IP, "netns", "add", probe)
    try:
        inside = (IP, "netns", "exec", probe)
        run(*inside, IP, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        for qdisc in (("prio",), ("netem", "delay", "1ms")):
            try:
                run(*inside, TC, "qdisc", "add", "dev", "probe0", "root", "handle", "1:", *qdisc)
            except NetnsError as exc:
                return f"this kernel has no {qdisc[0]} qdisc (CONFIG_NET_SCH_{qdisc[0].upper()}): {exc}"
            run(*inside, TC, "qdisc", "del", "dev", "probe0", "root")
        return None
    finally:
        with contextlib.suppress(NetnsError):
            run(IP, "netns", "del", probe)


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no route of this machine touches."""
    routes = [line.split()[0] for line in run(IP, "-4", "route", "show").splitlines() if line.strip()]
    taken = [ipaddress.ip_network(r, strict=False) for r in routes if r[0].isdigit()]
    for _ in range(100):
        candidate = ipaddress.IPv4Network(f"10.{200 + secrets.randbelow(8)}.{secrets.randbelow(256)}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    raise NetnsError("no free /24 in 10.200.0.0/13 for the bridge")


@dataclass(frozen=True)
class Host:
    name: str  # the mesh's name for it (a child's name: prefill-0)
    namespace: str  # the Linux network namespace
    address: str  # its IPv4 address on the bridge
    veth: str  # the root namespace's end of its veth pair, on the bridge


class Hosts:
    """A bridge in the root namespace and one namespace per host on it. The only writer of `hosts`."""

    def __init__(self) -> None:
        self.tag = f"kvm{secrets.token_hex(3)}"  # interface names are 15 bytes at most: kvm + 6 + -br
        self.bridge = f"{self.tag}-br"
        self.subnet = free_subnet()
        self._addresses = self.subnet.hosts()
        self.address = str(next(self._addresses))  # the bridge's, in the root namespace: NATS listens here
        self.hosts: dict[str, Host] = {}
        self.is_open = False
        self.has_forward_rule = False

    def open(self) -> Hosts:
        self.is_open = True  # from here on close() has something to remove
        run(IP, "link", "add", self.bridge, "type", "bridge")
        run(IP, "addr", "add", f"{self.address}/{self.subnet.prefixlen}", "dev", self.bridge)
        run(IP, "link", "set", self.bridge, "up")
        self._accept_bridged_traffic()
        return self

    def _forward_rule(self) -> tuple[str, ...]:
        return ("FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT")

    def _accept_bridged_traffic(self) -> None:
        """Where bridged packets pass through iptables (br_netfilter loaded) and the FORWARD chain drops by default
        (as a running Docker engine sets it), host-to-host traffic on the bridge would be dropped: accept it with
        a rule naming this run's bridge, removed by close(). Nothing is changed where packets are not filtered."""
        self.has_forward_rule = False
        try:
            with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as flag:
                filtered = flag.read().strip() == "1"
        except OSError:  # no br_netfilter: bridged packets never see iptables
            return
        if filtered and shutil.which(IPTABLES) is not None:
            run(IPTABLES, "-I", *self._forward_rule())
            self.has_forward_rule = True

    def add(self, name: str) -> Host:
        """A namespace for `name`, its veth pair on the bridge, the next address of the subnet."""
        index = len(self.hosts)
        host = Host(name, f"{self.tag}-{name}", str(next(self._addresses)), f"{self.tag}-{index}")
        self.hosts[name] = host
        peer = f"{self.tag}-p{index}"
        run(IP, "netns", "add", host.namespace)
        run(IP, "link", "add", host.veth, "type", "veth", "peer", "name", peer)
        run(IP, "link", "set", peer, "netns", host.namespace)
        run(IP, "link", "set", host.veth, "master", self.bridge)
        run(IP, "link", "set", host.veth, "up")
        inside = (IP, "netns", "exec", host.namespace, IP)
        run(*inside, "link", "set", peer, "name", DEVICE)
        run(*inside, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", DEVICE)
        run(*inside, "link", "set", DEVICE, "up")  # loopback stays down: nothing may use it
        return host

    def command(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run inside `name`'s namespace (`ip netns exec` execs it: its pid is the command's own)."""
        return [IP, "netns", "exec", self.hosts[name].namespace, *argv]

    def impair(self, first: str, second: str, delay_ms: float, loss_pct: float) -> None:
        """Delay and lose packets between two hosts, both ways, and only between them: on each one's device, a
        prio qdisc sends what goes to the other through netem (band 3); other traffic keeps the clean bands."""
        for here, there in ((first, second), (second, first)):
            tc = (IP, "netns", "exec", self.hosts[here].namespace, TC)
            run(*tc, "qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "prio")
            netem = ("netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%")
            run(*tc, "qdisc", "add", "dev", DEVICE, "parent", "1:3", "handle", "30:", *netem)
            match = ("u32", "match", "ip", "dst", f"{self.hosts[there].address}/32", "flowid", "1:3")
            run(*tc, "filter", "add", "dev", DEVICE, "protocol", "ip", "parent", "1:0", "prio", "3", *match)

    def connect_ms(self, name: str, address: str, port: int, count: int = 7) -> float:
        """The median time a TCP connect from host `name` to address:port takes (about one round trip)."""
        probe = (
            "import socket, statistics, time\n"
            "times = []\n"
            f"for _ in range({count}):\n"
            "    started = time.perf_counter()\n"
            f"    socket.create_connection(({address!r}, {port}), timeout=5).close()\n"
            "    times.append(time.perf_counter() - started)\n"
            "print(statistics.median(times) * 1000)\n"
        )
        return float(run(*self.command(name, [sys.executable, "-c", probe])).strip())

    def clear(self, *names: str) -> None:
        """Remove the impairments of `names` (their devices' default qdisc again)."""
        for name in names:
            with contextlib.suppress(NetnsError):
                run(IP, "netns", "exec", self.hosts[name].namespace, TC, "qdisc", "del", "dev", DEVICE, "root")

    def close(self) -> None:
        """Remove every namespace (and with it its veth pair) and the bridge; what is already gone is skipped."""
        for host in self.hosts.values():
            with contextlib.suppress(NetnsError):
                run(IP, "netns", "del", host.namespace)
            with contextlib.suppress(NetnsError):
                run(IP, "link", "del", host.veth)
        if self.is_open:
            if self.has_forward_rule:
                with contextlib.suppress(NetnsError):
                    run(IPTABLES, "-D", *self._forward_rule())
                self.has_forward_rule = False
            with contextlib.suppress(NetnsError):
                run(IP, "link", "del", self.bridge)
        self.hosts.clear()
        self.is_open = False

    def leftovers(self) -> list[str]:
        """This run's namespaces and links still present (after close(): none)."""
        namespaces = [line.split()[0] for line in run(IP, "netns", "list").splitlines() if line.strip()]
        links = [line.split(":")[1].strip().split("@")[0] for line in run(IP, "-o", "link").splitlines()]
        rules = run(IPTABLES, "-S", "FORWARD").splitlines() if shutil.which(IPTABLES) else []
        return [name for name in namespaces + links + rules if self.tag in name]

    def __enter__(self) -> Hosts:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetnsMesh(Mesh):
    """`kvmesh up`'s mesh with every child on a host of its own (`Hosts`), NATS on the bridge's address."""

    def __init__(self, hosts: Hosts, plan: MeshPlan, out=None) -> None:  # type: ignore[no-untyped-def]
        if plan.gateway != 1:
            raise ValueError("a mesh across namespaces runs one gateway (replicas share a port on one host)")
        super().__init__(plan, out)
        self.hosts = hosts
        self.nats_host = hosts.address
        for _, worker_id in self.planned_workers():
            hosts.add(worker_id)

    @property
    def gateway_host(self) -> str:
        return self.hosts.hosts["gateway-0"].address

    def child_command(self, role: str, index: int) -> list[str]:
        return self.hosts.command(f"{role}-{index}", super().child_command(role, index))

    def child_env(self, role: str, index: int, http_port: int, grpc_port: int = 0) -> dict[str, str]:
        env = super().child_env(role, index, http_port, grpc_port)
        env["KVMESH_HOST"] = self.hosts.hosts[f"{role}-{index}"].address
        return env

    def child_host(self, name: str) -> str:
        return self.hosts.hosts[name].address
