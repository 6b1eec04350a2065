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
task measures how late it woke and does not count that time against anyone. Likewise while NATS is away
(the bus's connection is down): no heartbeat can arrive, so every worker stays at its last known state, marked
`is_stale`, and the outage's time is excused.

NATS is not on the request path: where a `mesh.health.HealthProber` checks the registry's workers over gRPC
(gateways and balancers), silence alone never removes a worker. Liveness is then the health checks' and the
callers' (`record_failure`): `eject_after_failures` consecutive failures eject a worker from `workers()`
(mesh.outliers), a health check that passes re-admits it (a heartbeat, where nothing checks health), and a
worker both ejected and silent for MISSED_HEARTBEATS intervals while NATS is up has left for good.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from mesh import metrics, rpc, subjects
from mesh.bus import Bus
from mesh.health import HealthProber
from mesh.logging import get_logger
from mesh.outliers import OutlierDetector
from mesh.pb import common_pb2, events_pb2

MISSED_HEARTBEATS = 3
log = get_logger(__name__)

LEAVING_FLUSH_TIMEOUT_S = 3  # how long a stopping worker waits for NATS to confirm its "leaving" beat

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
        if not self.bus.is_connected:
            return
        try:  # best effort: peers that miss the "leaving" beat drop this worker when its heartbeats stop
            await self._beat(leaving=True)
            await self.bus.flush(timeout_s=LEAVING_FLUSH_TIMEOUT_S)
        except Exception as error:  # a loaded or leaving server must not turn a clean stop into a failure
            log.warning("leaving heartbeat not confirmed", worker_id=self.info.worker_id, error=repr(error))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._beat()
            except Exception:  # NATS briefly away: the next beat retries
                log.warning("heartbeat failed", worker_id=self.info.worker_id, exc_info=True)

    async def _beat(self, leaving: bool = False) -> None:
        beat = events_pb2.WorkerHeartbeat(worker=self.info, load=self.load(), timestamp_ms=now_ms(), leaving=leaving)
        await self.bus.publish(subjects.worker_heartbeat(ROLE_NAMES[self.info.role], self.info.worker_id), beat)


def model_block_size(info: common_pb2.WorkerInfo, model: str) -> int:
    """Tokens per block of `model` on this worker: its engine's, as reported; a worker of an older build reports
    none per model, so its one `block_size`."""
    return info.model_block_sizes.get(model) or info.block_size


def worker_block_size(info: common_pb2.WorkerInfo) -> int | None:
    """Tokens per block shared by every model the worker serves (`model_block_size`), so that a count of its blocks
    over all its engines (WorkerLoad's) is that many tokens per block; None when its models' block sizes differ
    (a V4-Flash engine's 128 beside Llama's 16): such a count has no one size in tokens."""
    sizes = {model_block_size(info, model) for model in info.models} or {info.block_size}
    return sizes.pop() if len(sizes) == 1 else None


@dataclass
class KnownWorker:
    info: common_pb2.WorkerInfo
    load: common_pb2.WorkerLoad
    last_seen_ms: int  # wall clock, for reports
    heard_s: float = 0.0  # the registry's monotonic clock, less time it could not listen: for liveness
    beat_s: float = 0.0  # the registry's monotonic clock at its last heartbeat, nothing excused
    is_stale: bool = False  # no heartbeat for MISSED_HEARTBEATS intervals: its load is the last one heard

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class WorkerRegistry:
    """Live workers of the followed roles. The registry's own tasks (and callers' `record_*`, on the same loop)
    are the only writers of `_workers` and `outliers`."""

    def __init__(
        self,
        bus: Bus,
        roles: Iterable[int],
        interval_s: float,
        on_leave: Callable[[KnownWorker], None] | None = None,
        eject_after_failures: int = 3,
    ) -> None:
        self.bus = bus
        self.roles = tuple(roles)
        self.interval_s = interval_s
        self.on_leave = on_leave
        self._workers: dict[str, KnownWorker] = {}
        self.outliers = OutlierDetector(eject_after_failures)
        self.is_probed = False  # a HealthProber checks these workers: silence alone removes nobody
        self._prober: HealthProber | None = None
        self.num_forged = 0  # heartbeats dropped because they named another worker than their subject
        self._forged_subjects: set[str] = set()  # logged once each
        self._subscriptions: list = []
        self._task: asyncio.Task[None] | None = None

    def check_health(self, channels: rpc.Channels, interval_s: float, timeout_s: float) -> None:
        """Before `start`: check every known worker over gRPC every `interval_s` (0: never; mesh.health)."""
        self._prober = HealthProber(self, channels, interval_s, timeout_s) if interval_s > 0 else None

    async def start(self) -> None:
        for role in self.roles:
            subject = subjects.heartbeat(ROLE_NAMES[role])
            self._subscriptions.append(await self.bus.subscribe(subject, events_pb2.WorkerHeartbeat, self._on_beat))
        self._task = asyncio.create_task(self._prune_forever())
        if self._prober is not None:
            self._prober.start()

    async def stop(self) -> None:
        if self._prober is not None:
            await self._prober.stop()
        if self._task is not None:
            self._task.cancel()
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()

    def workers(self, role: int | None = None, model: str | None = None) -> list[KnownWorker]:
        """Live workers (stale ones included, ejected ones not), optionally of one role and serving one model, in
        worker-id order."""
        found = [
            w
            for w in self._workers.values()
            if (role is None or w.info.role == role)
            and (model is None or model in w.info.models)
            and not self.outliers.is_ejected(w.worker_id)
        ]
        return sorted(found, key=lambda w: w.worker_id)

    @property
    def num_stale(self) -> int:
        return sum(w.is_stale for w in self._workers.values())

    @property
    def num_ejected(self) -> int:
        return sum(self.outliers.is_ejected(worker_id) for worker_id in self._workers)

    def export_metrics(self) -> None:
        """The pools' stale and ejected workers, read at each scrape (one registry per process exports them)."""
        metrics.POOL_STALE_WORKERS.set_function(lambda: self.num_stale)
        metrics.POOL_EJECTED_WORKERS.set_function(lambda: self.num_ejected)

    def addresses(self) -> dict[str, str]:
        """Every known worker's gRPC address, ejected ones included (health checks may re-admit them)."""
        return {w.worker_id: w.info.address for w in self._workers.values()}

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
        now = time.monotonic()
        self._workers[worker_id] = KnownWorker(beat.worker, beat.load, now_ms(), now, now)
        if not self.is_probed:  # else health checks re-admit: a beat on NATS says nothing of its gRPC
            self.record_success(worker_id)

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

    def record_failure(self, worker_id: str, late: bool = False) -> None:
        """A call to the worker, or a health check, failed: counted towards its ejection (mesh.outliers). A `late`
        one (no answer within the deadline) never ejects the last worker of its role left in the pools: when the
        machine is loaded every answer is late, and an empty pool fails every request while a slow one serves."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        would_eject = self.outliers.num_failures(worker_id) + 1 >= self.outliers.eject_after
        if late and would_eject and not self.outliers.is_ejected(worker_id) and not self._others_in_pool(worker):
            return
        if self.outliers.failure(worker_id):
            log.warning("worker ejected", worker_id=worker_id, num_failures=self.outliers.eject_after, late=late)

    def _others_in_pool(self, worker: KnownWorker) -> bool:
        return any(
            w.info.role == worker.info.role
            and w.worker_id != worker.worker_id
            and not self.outliers.is_ejected(w.worker_id)
            for w in self._workers.values()
        )

    def record_success(self, worker_id: str) -> None:
        """The worker answered (a health check, a heartbeat): an ejected one is back in its pools."""
        if self.outliers.success(worker_id):
            log.info("worker re-admitted", worker_id=worker_id)

    def is_ejected(self, worker_id: str) -> bool:
        return self.outliers.is_ejected(worker_id)

    def _remove(self, worker_id: str, reason: str) -> None:
        worker = self._workers.pop(worker_id, None)
        self.outliers.forget(worker_id)
        if worker is not None:
            log.info("worker left", worker_id=worker_id, reason=reason)
            if self.on_leave is not None:
                self.on_leave(worker)

    def prune(self) -> None:
        """Mark the silent stale; remove those silent (time excused aside) who are ejected, or not health-checked."""
        now = time.monotonic()
        deadline = now - MISSED_HEARTBEATS * self.interval_s
        for worker in list(self._workers.values()):
            worker.is_stale = worker.beat_s < deadline
            if worker.heard_s < deadline and (not self.is_probed or self.outliers.is_ejected(worker.worker_id)):
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
            slept_s = time.monotonic() - slept_from
            if not self.bus.is_connected:  # NATS is away: no heartbeat could arrive
                self.excuse(slept_s)
            elif slept_s - period > period:  # the loop stalled: beats sent meanwhile may still sit unread
                self.excuse(slept_s - period)
            self.prune()
