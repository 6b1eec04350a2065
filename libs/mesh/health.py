"""Liveness over gRPC, so that NATS is not on the request path.

Every role's gRPC server answers the standard `grpc.health.v1.Health/Check` (proto/grpc/health/v1): SERVING for
"" and for its own worker id while it takes work, NOT_SERVING once it stops, NOT_FOUND for any other name. A
caller asks by worker id, so a process that took over the address (a restart under another id) does not pass
for the one that died there. A server that answers UNIMPLEMENTED or PERMISSION_DENIED (a worker of a version
before health checks) is up.

`HealthProber` checks every worker a WorkerRegistry knows, all at once every `interval_s`, each with a deadline of
`timeout_s`, and reports each answer to the registry: a failure counts towards the worker's ejection (mesh.outliers),
a success re-admits it. Gateways and balancers run one, bus or no bus; a dead worker (its port refuses at once) is
out after `eject_after_failures` rounds, about 1-1.5 s with the defaults.

A round that took far longer than its deadline means this process's own loop stalled (the answers may have sat
unread): its failures are nobody's and are not counted, as the registry does with heartbeats. A late answer is
weaker evidence than a refusal (on a loaded machine every answer is late), so lateness alone never ejects the
last worker of a role left in the pools (the registry's rule, after Envoy's `max_ejection_percent`); a refused
check or call always counts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from mesh import rpc
from mesh.logging import get_logger
from mesh.pb import health_pb2, health_pb2_grpc
from mesh.tasks import cancel_until_done

log = get_logger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, worker_id: str, is_serving: Callable[[], bool]) -> None:
        self.worker_id = worker_id
        self.is_serving = is_serving

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", self.worker_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this is {self.worker_id}, not {request.service}")
        return health_pb2.HealthCheckResponse(status=SERVING if self.is_serving() else NOT_SERVING)


# what a worker of a version before health checks answers: it is up, it just does not serve the method (or its
# access table does not list it), so a rollout from such a version does not eject the old workers
ANSWERED_WITHOUT_HEALTH = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED})


UP, DOWN, LATE = "up", "down", "late"  # a check's outcome: LATE is no answer within the deadline


async def check(channel: grpc.aio.Channel, worker_id: str, timeout_s: float) -> str:
    """UP when `worker_id` answers SERVING on `channel` within `timeout_s` (or answers at all, without health);
    LATE when no answer came in time (a black-holed host, or a busy one: a loaded machine makes every answer late);
    DOWN otherwise (refused, not serving, another worker at the address)."""
    try:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=worker_id), timeout=timeout_s
        )
    except grpc.aio.AioRpcError as error:
        if error.code() in ANSWERED_WITHOUT_HEALTH:
            return UP
        return LATE if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else DOWN
    return UP if response.status == SERVING else DOWN


async def is_serving(channel: grpc.aio.Channel, worker_id: str, timeout_s: float) -> bool:
    return await check(channel, worker_id, timeout_s) == UP


class Probed(Protocol):
    """What the prober needs of a registry (mesh.discovery.WorkerRegistry)."""

    is_probed: bool

    def addresses(self) -> dict[str, str]: ...

    def record_success(self, worker_id: str) -> None: ...

    def record_failure(self, worker_id: str, late: bool = False) -> None: ...


class HealthProber:
    def __init__(self, registry: Probed, channels: rpc.Channels, interval_s: float, timeout_s: float) -> None:
        self.registry = registry
        self.channels = channels
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.num_rounds = 0
        self.num_stalled_rounds = 0  # rounds whose failures were not counted: this process's loop was late
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval_s <= 0:
            return
        self.registry.is_probed = True
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await cancel_until_done(self._task)
        self._task = None

    async def probe_once(self) -> None:
        """Check every known worker once, concurrently, and report the answers."""
        addresses = self.registry.addresses()
        started = time.monotonic()
        answers = await asyncio.gather(
            *(check(self.channels.get(address), worker_id, self.timeout_s) for worker_id, address in addresses.items())
        )
        stalled = time.monotonic() - started > 2 * self.timeout_s + 0.1
        self.num_rounds += 1
        self.num_stalled_rounds += stalled
        for worker_id, answer in zip(addresses, answers, strict=True):
            if answer == UP:
                self.registry.record_success(worker_id)
            elif not stalled:
                self.registry.record_failure(worker_id, late=answer == LATE)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.probe_once()
            except Exception:  # one bad round must not end liveness checks
                log.warning("health checks failed to run", exc_info=True)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
