"""The fault harness: one fault at a time against a live mesh under a steady load (load.py), and for each the
requests failed out of those it could touch and the seconds to recovery. tests/faults/ asserts the goals with it;
`kvmesh bench faults --json` runs every fault with a longer load and prints the figures docs/reliability.md quotes.

A fault's window: the requests in flight when it is injected and those started in the `observe_s` after it.
`recovery_s`: from the fault to the end of the last disturbed request of the window, where a request is disturbed
when it failed or took longer than twice the baseline's p95 (the requests that ended in the 20 s before the
fault, and started after the previous fault's window where there are enough); 0 when none was. A killed worker
is not started again until the fault is measured: the figures are those of a mesh on its remaining replica.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.bench.load import Load, Outcome

if TYPE_CHECKING:
    from kvmesh.up import Child, Mesh

BASELINE_S = 20.0  # the requests that ended this long before a fault are its baseline


@dataclass
class FaultResult:
    name: str
    num_requests: int  # in flight at the fault or started within observe_s after it
    num_failed: int
    recovery_s: float
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by kind of error
    tpot_p99_ms: float | None = None  # of the window's streams
    baseline_tpot_p99_ms: float | None = None
    details: list[str] = field(default_factory=list)  # the first few errors' bodies
    notes: dict[str, Any] = field(default_factory=dict)  # what the fault hit (the victim, its streams, ...)

    def figures(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != [] and v != {}}


def percentile(samples: list[float], fraction: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _tpot_p99_ms(outcomes: list[Outcome]) -> float | None:
    p99 = percentile([t for o in outcomes if o.is_ok and (t := o.tpot_s) is not None], 0.99)
    return None if p99 is None else round(p99 * 1000, 1)


def measure(
    load: Load, name: str, inject: Callable[[], None], observe_s: float = 3.0, quiet_since_s: float = 0.0
) -> FaultResult:
    """Inject one fault under `load` and account for every request it could have touched. `quiet_since_s`:
    the end of the previous fault's window (monotonic); the baseline is what started after it, when it has at
    least three requests (else the last BASELINE_S seconds)."""
    t0 = time.monotonic()
    recent = [o for o in load.outcomes() if o.is_ok and o.ended_s > t0 - BASELINE_S]
    quiet = [o for o in recent if o.started_s >= quiet_since_s]
    baseline = quiet if len(quiet) >= 3 else recent
    slow_s = 2 * (percentile([o.latency_s for o in baseline], 0.95) or 0.0)
    inject()
    time.sleep(observe_s)
    t1 = time.monotonic()
    deadline = t1 + load.timeout_s + 5
    while any(o.started_s <= t1 for o in load.in_flight()) and time.monotonic() < deadline:
        time.sleep(0.05)
    window = [o for o in load.outcomes() if o.ended_s >= t0 and o.started_s <= t1]
    failed = [o for o in window if not o.is_ok]
    disturbed = [o for o in window if not o.is_ok or (slow_s and o.latency_s > slow_s)]
    return FaultResult(
        name=name,
        num_requests=len(window),
        num_failed=len(failed),
        recovery_s=round(max((o.ended_s - t0 for o in disturbed), default=0.0), 2),
        errors=dict(Counter(str(o.error) for o in failed)),
        tpot_p99_ms=_tpot_p99_ms(window),
        baseline_tpot_p99_ms=_tpot_p99_ms(baseline),
        details=[f"{o.kind} {o.error}: {o.detail}" for o in failed[:3]],
    )


# the mesh's side: signals, metrics, replacements


def metric_lines(port: int, key: str | None) -> list[str]:
    """A child's /metrics; `key`: the admin key the gateway's public port asks for."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=5) as response:
        return list(response.read().decode().splitlines())


def metric_total(port: int, metric: str, key: str | None = None) -> float:
    """The sum of one metric's samples on a child's /metrics."""
    lines = metric_lines(port, key)
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.split("{")[0].split(" ")[0] == metric)


def metric_sample(port: int, metric: str, labels: str, key: str | None = None) -> float:
    """One sample of a metric on a child's /metrics, by its label string (`pool="decode"`); 0 when absent."""
    lines = metric_lines(port, key)
    prefix = f"{metric}{{{labels}}} "
    return next((float(line[len(prefix) :]) for line in lines if line.startswith(prefix)), 0.0)


def is_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> float:
    """Seconds until `condition` held; raises TimeoutError naming `what`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - start


def kill(mesh: Mesh, name: str, sig: int = signal.SIGKILL) -> None:
    mesh.kill(name, sig)


def replace(mesh: Mesh, name: str, env: dict[str, str] | None = None, wait: bool = True) -> Child:
    """Start `name` again (`env`: settings of its own); with `wait`, until it is ready and heard by the pools."""
    role, index = name.rsplit("-", 1)
    child = mesh.spawn(role, int(index), env=env)
    if wait:
        wait_until_serving(child)
    return child


def wait_until_serving(child: Child, timeout_s: float = 180.0) -> None:
    wait_for(lambda: is_ready(child.http_port), timeout_s, f"{child.name} ready", interval_s=0.25)
    time.sleep(1.5)  # three heartbeats at the suite's 0.5 s: in every pool


# one streamed request followed by the caller, for faults that hit the process serving it


class ProbeStream:
    """One long streamed chat, read in a thread of its own: who serves it, how many tokens came, whether it ended
    whole (`[DONE]` after a usage that counts every token asked for)."""

    def __init__(self, base_url: str, api_key: str, model: str, max_tokens: int, is_ignore_eos: bool = True) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Count from one to one hundred, in words."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": is_ignore_eos,
        }
        self.request = urllib.request.Request(
            base_url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        )
        self.max_tokens = max_tokens
        self.headers: dict[str, str] = {}
        self.num_chunks = 0
        self.num_completion_tokens: int | None = None
        self.is_done = False
        self.error: str | None = None
        self._response: Any = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self, min_chunks: int = 2, timeout_s: float = 60.0) -> ProbeStream:
        self._thread.start()
        wait_for(lambda: self.num_chunks >= min_chunks or not self._thread.is_alive(), timeout_s, "the probe's tokens")
        return self

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self.request, timeout=120) as response:
                self._response = response
                self.headers = dict(response.headers)
                for raw in response:
                    if self._closed.is_set():
                        return
                    line = raw.decode().strip()
                    if line == "data: [DONE]":
                        self.is_done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        self.num_chunks += 1
                        if "error" in chunk:
                            self.error = f"error frame: {json.dumps(chunk['error'])[:300]}"
                        if chunk.get("usage"):
                            self.num_completion_tokens = chunk["usage"]["completion_tokens"]
        except urllib.error.HTTPError as refused:  # the body names the cause (which pool was empty, ...)
            self.error = f"HTTPError {refused.code}: {refused.read()[:300].decode(errors='replace')}"
        except Exception as exc:  # the probe's verdict: the caller asserts on it
            if not self._closed.is_set():
                self.error = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        """Hang up mid-stream, as a client that goes away does."""
        if not self._thread.is_alive():  # nothing to hang up: say how it ended
            raise RuntimeError(f"the stream ended before the hang-up (done: {self.is_done}, error: {self.error})")
        self._closed.set()
        self._response.fp.raw._sock.shutdown(2)  # the socket itself: the gateway sees the peer gone at once
        self._response.close()

    def wait(self, timeout_s: float = 120.0) -> ProbeStream:
        self._thread.join(timeout_s)
        return self

    @property
    def is_whole(self) -> bool:
        return self.error is None and self.is_done and self.num_completion_tokens == self.max_tokens
