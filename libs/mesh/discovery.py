"""Workers announce themselves on NATS; pools are built from what is heard, never from static lists.

`Announcer` publishes this worker's WorkerHeartbeat every interval (and a last one with `leaving` set on
shutdown). `WorkerRegistry` follows heartbeats of some roles and keeps who is alive: a worker joins on its
first heartbeat and leaves on `leaving` or after `MISSED_HEARTBEATS` intervals of silence.

A heartbeat is heard only from the worker it names: it travels on `kvmesh.workers.<role>.<worker id>`, NATS lets a
user publish only its own role's (or, under `kvmesh up`, its own worker's) subjects (mesh.bus_auth), and the
registry drops one whose WorkerInfo names another role or worker than its subject, so a decode worker can neither
join the balancers nor make another worker leave.

Silence is counted only while the registry could listen. When its event loop stalls (a long synchronous step,
a paused process, a test session's loop idle between tests), heartbeats wait unread in the socket; a prune
that wakes first would drop every worker at once and answer the next request with "no workers". The prune
task measures how late it woke and does not count that time against anyone.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from mesh import subjects
from mesh.bus import Bus
from mesh.logging import get_logger
from mesh.pb import common_pb2, events_pb2

MISSED_HEARTBEATS = 3
log = get_logger(__name__)

ROLE_NAMES: dict[int, str] = {
    common_pb2.ROLE_GATEWAY: "gateway",
    common_pb2.ROLE_ENCODER: "encoder",
    common_pb2.ROLE_PREFILL: "prefill",
    common_pb2.ROLE_DECODE: "decode",
    common_pb2.ROLE_KVCACHE: "kvcache",
    common_pb2.ROLE_BALANCER: "balancer",
    common_pb2.ROLE_EXPERT_LB: "expert_lb",
}


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def advertise_host(bind_host: str, configured: str, bus_url: str = "") -> str:
    """The host other roles should dial: configured, else the bind host, else (bound to every interface) the
    address of the interface this machine reaches the bus through, else this machine's name.

    Why not the name: it works only where some DNS knows it. Docker's DNS on a user-defined network resolves a
    container's id (its default hostname), but not on the default bridge, nor a custom `hostname:`; Kubernetes
    pods' names need a headless service. Every role reaches the bus, so the address of the interface on the
    bus's network is one every peer can dial, with no DNS at all.
    """
    if configured:
        return _host_form(configured)
    if bind_host in ("0.0.0.0", "::", ""):
        return address_towards(bus_url) or socket.gethostname()
    return _host_form(bind_host)


def _host_form(host: str) -> str:
    """`host` as it goes before `:port`: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def address_towards(url: str) -> str | None:
    """This machine's address on the route to `url`'s host (the first, for a list of servers), or None.

    A UDP connect sends nothing: it only asks the kernel which local address it would send from.
    """
    host, port = _first_host_port(url)
    if not host:
        return None
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            address = str(probe.getsockname()[0])
    except OSError:  # unresolvable or no route: the caller falls back
        return None
    return _host_form(address)


def _first_host_port(url: str) -> tuple[str | None, int]:
    parts = urlsplit(url.split(",")[0].strip())
    try:
        port = parts.port or 4222
    except ValueError:
        port = 4222
    return parts.hostname, port


def now_ms() -> int:
    return int(time.time() * 1000)


class Announcer:
    def __init__(
        self, bus: Bus, info: common_pb2.WorkerInfo, load: Callable[[], common_pb2.WorkerLoad], interval_s: float
    ) -> None:
        self.bus = bus
        self.info = info
        self.load = load
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._beat()  # join at once, not one interval later
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop beating and tell the mesh this worker is leaving."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.bus.is_connected:
            await self._beat(leaving=True)
            await self.bus.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._beat()
            except Exception:  # NATS briefly away: the next beat retries
                log.warning("heartbeat failed", exc_info=True)

    async def _beat(self, leaving: bool = False) -> None:
        beat = events_pb2.WorkerHeartbeat(worker=self.info, load=self.load(), timestamp_ms=now_ms(), leaving=leaving)
        await self.bus.publish(subjects.worker_heartbeat(ROLE_NAMES[self.info.role], self.info.worker_id), beat)


@dataclass
class KnownWorker:
    info: common_pb2.WorkerInfo
    load: common_pb2.WorkerLoad
    last_seen_ms: int  # wall clock, for reports
    heard_s: float = 0.0  # the registry's monotonic clock, less time it could not listen: for liveness

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class WorkerRegistry:
    """Live workers of the followed roles. The registry's own tasks are the only writers of `_workers`."""

    def __init__(
        self, bus: Bus, roles: Iterable[int], interval_s: float, on_leave: Callable[[KnownWorker], None] | None = None
    ) -> None:
        self.bus = bus
        self.roles = tuple(roles)
        self.interval_s = interval_s
        self.on_leave = on_leave
        self._workers: dict[str, KnownWorker] = {}
        self.num_forged = 0  # heartbeats dropped because they named another worker than their subject
        self._forged_subjects: set[str] = set()  # logged once each
        self._subscriptions: list = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for role in self.roles:
            subject = subjects.heartbeat(ROLE_NAMES[role])
            self._subscriptions.append(await self.bus.subscribe(subject, events_pb2.WorkerHeartbeat, self._on_beat))
        self._task = asyncio.create_task(self._prune_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()

    def workers(self, role: int | None = None, model: str | None = None) -> list[KnownWorker]:
        """Live workers, optionally of one role and serving one model, in worker-id order."""
        found = [
            w
            for w in self._workers.values()
            if (role is None or w.info.role == role) and (model is None or model in w.info.models)
        ]
        return sorted(found, key=lambda w: w.worker_id)

    def get(self, worker_id: str) -> KnownWorker | None:
        return self._workers.get(worker_id)

    async def _on_beat(self, beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        worker_id = beat.worker.worker_id
        if not subjects.heartbeat_names(subject, ROLE_NAMES.get(beat.worker.role, "?"), worker_id):
            self._drop_forged(beat, subject)
            return
        if beat.leaving:
            self._remove(worker_id, "announced leaving")
            return
        if worker_id not in self._workers:
            log.info(
                "worker joined",
                worker_id=worker_id,
                role=ROLE_NAMES.get(beat.worker.role),
                address=beat.worker.address,
                models=list(beat.worker.models),
            )
        self._workers[worker_id] = KnownWorker(beat.worker, beat.load, now_ms(), time.monotonic())

    def _drop_forged(self, beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        self.num_forged += 1
        if subject not in self._forged_subjects and len(self._forged_subjects) < 1024:
            self._forged_subjects.add(subject)
            log.warning(
                "heartbeat dropped: it names another worker than its subject",
                subject=subject,
                role=ROLE_NAMES.get(beat.worker.role, str(beat.worker.role)),
                worker_id=beat.worker.worker_id,
            )

    def mark_failed(self, worker_id: str) -> None:
        """A call to the worker failed: take it out of the pools until it is heard from again."""
        self._remove(worker_id, "unreachable")

    def _remove(self, worker_id: str, reason: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            log.info("worker left", worker_id=worker_id, reason=reason)
            if self.on_leave is not None:
                self.on_leave(worker)

    def prune(self) -> None:
        deadline = time.monotonic() - MISSED_HEARTBEATS * self.interval_s
        for worker in [w for w in self._workers.values() if w.heard_s < deadline]:
            self._remove(worker.worker_id, "missed heartbeats")

    def excuse(self, deaf_s: float) -> None:
        """The registry could not listen for `deaf_s` seconds: that silence is nobody's."""
        for worker in self._workers.values():
            worker.heard_s += deaf_s

    async def _prune_forever(self) -> None:
        period = self.interval_s / 2
        while True:
            slept_from = time.monotonic()
            await asyncio.sleep(period)
            late_s = time.monotonic() - slept_from - period
            if late_s > period:  # the loop stalled: beats sent meanwhile may still sit unread
                self.excuse(late_s)
            self.prune()
