"""`kvmesh up`'s supervisor: a child that dies is started again under its own name, worker id and ports, so
the pools it was in heal without anyone's help.

    supervisor = Supervisor(mesh, RestartPolicy())
    supervisor.start()      # a thread: every poll_s, restart what died (after its backoff)
    ...
    supervisor.stop()       # before the mesh stops its children, so a stopping child is not restarted

The delay before a restart starts at `first_delay_s` and doubles with each crash in a row, up to `max_delay_s`;
a child that ran for `window_s` before it died starts over at `first_delay_s`. A child that dies `max_crashes`
times within `window_s` is a crash loop: it is left down, with a message saying so (its own output, above in the
console, says why). Each restart is a console line, and the counts are in `Mesh.restart_counts()`.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

TAIL_LINES = 40  # a child's last output lines kept, for the error that says it died


@dataclass
class Child:
    """One child process of `kvmesh up`. `process` is replaced on a restart; the rest stays."""

    name: str  # e.g. prefill-1; also its KVMESH_WORKER_ID
    role: str
    index: int
    process: subprocess.Popen
    http_port: int  # its /healthz, /readyz and /metrics
    grpc_port: int  # fixed for its life and its restarts (0: any, announced)
    env: dict[str, str] = field(default_factory=dict)  # its own settings over the plan's (a canary's version)
    num_restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    reported: bool = False  # its exit has been reported
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))  # its output's end, for errors
    pump: threading.Thread | None = None  # copies `process`'s output (replaced with it)

    def output_tail(self) -> str:
        return "\n".join(self.last_lines)


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    max_crashes: int = 5  # this many exits within window_s: a crash loop, left down
    window_s: float = 60.0
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("restart delays must be positive, the first at most the largest")
        if self.max_crashes < 1 or self.window_s <= 0:
            raise ValueError("a crash loop needs at least one crash within a positive window")

    def delay_s(self, num_crashes_in_a_row: int) -> float:
        """Seconds before restart number `num_crashes_in_a_row` (1, 2, ...): 1 s, 2 s, 4 s ... capped."""
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (num_crashes_in_a_row - 1))


class Supervised(Protocol):
    """What the supervisor needs of the mesh (kvmesh.up.Mesh)."""

    is_stopping: bool

    def dead_children(self) -> list[Child]: ...

    def restart(self, child: Child) -> Child: ...

    def say(self, text: str) -> None: ...


@dataclass
class _Record:
    """The supervisor's own bookkeeping for one child name (only the supervisor's thread writes it)."""

    exit_times: deque[float] = field(default_factory=deque)  # within the last window_s
    num_in_a_row: int = 0  # crashes without a run of window_s between them
    restart_at: float | None = None  # when the pending restart is due
    is_given_up: bool = False


class Supervisor:
    def __init__(
        self, mesh: Supervised, policy: RestartPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.mesh = mesh
        self.policy = policy or RestartPolicy()
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="kvmesh-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def given_up(self) -> list[str]:
        """Names of the children left down after a crash loop."""
        return sorted(name for name, record in self._records.items() if record.is_given_up)

    def _run(self) -> None:
        while not self._stop.wait(self.policy.poll_s):
            self.step()

    def step(self) -> None:
        """Note new exits, then restart the children whose backoff has passed."""
        now = self._clock()
        for child in self.mesh.dead_children():
            if self._stop.is_set() or self.mesh.is_stopping:
                return
            record = self._records.setdefault(child.name, _Record())
            if not child.reported:
                child.reported = True
                self._note_exit(child, record, now)
            if record.restart_at is not None and now >= record.restart_at:
                record.restart_at = None
                restarted = self.mesh.restart(child)
                self.mesh.say(
                    f"kvmesh: {child.name} restarted (pid {restarted.process.pid}, restart {restarted.num_restarts})"
                )

    def _note_exit(self, child: Child, record: _Record, now: float) -> None:
        policy = self.policy
        record.exit_times.append(now)
        while record.exit_times and record.exit_times[0] < now - policy.window_s:
            record.exit_times.popleft()
        ran_s = now - child.started_at
        record.num_in_a_row = 1 if ran_s >= policy.window_s else record.num_in_a_row + 1
        code = child.process.returncode
        if len(record.exit_times) >= policy.max_crashes:
            record.is_given_up = True
            self.mesh.say(
                f"kvmesh: {child.name} exited with code {code}: {len(record.exit_times)} exits within "
                f"{policy.window_s:g} s, a crash loop, so it stays down (its output above says why; "
                f"restart kvmesh up once it is fixed)"
            )
            return
        delay_s = policy.delay_s(record.num_in_a_row)
        record.restart_at = now + delay_s
        self.mesh.say(
            f"kvmesh: {child.name} exited with code {code}; restarting it in {delay_s:g} s "
            f"(restart {child.num_restarts + 1})"
        )
