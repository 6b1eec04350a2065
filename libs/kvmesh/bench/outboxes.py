"""What a NATS outage leaves in the mesh's outboxes, and whether the global KV index lost anything.

`OutboxWatch` reads every outbox of a running mesh (the `kvmesh_outbox_*` gauges of prefill, decode and the store
nodes, mesh.outbox; the gateway's usage queue, services/gateway/tenancy/ledger.py) every `interval_s`, from NATS's
kill until each is empty again after NATS is back, and reports per outbox: its peak size during the outage, the
messages it sent from NATS's return until it was empty (the replay), and the seconds that took.
`kv_index_agrees` is the end check: the store node's holdings, the KV stream replayed, and every balancer's index.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.error
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.bench.faults import metric_lines, metric_sample, metric_total
from mesh.bus import Bus
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import KVEventFollower

if TYPE_CHECKING:
    from kvmesh.up import Mesh

OUTBOX_ROLES = ("prefill", "decode", "kvcache")  # the roles with a mesh.outbox
_SAMPLE = re.compile(r'^(kvmesh_outbox_messages(?:_peak|_sent)?)\{outbox="([^"]+)"\} (\S+)$')


@dataclass
class OutboxFigures:
    """One outbox of one process through an outage."""

    peak_at_kill: float  # its peak gauge (since its process started) when NATS was killed
    num_peak: int = 0  # the most messages it held from the kill until it was empty again
    num_sent_at_return: int = 0
    num_replayed: int = 0  # messages sent from NATS's return until it was empty
    drained_s: float | None = None  # from NATS's return until it was empty; None: not within the watch


class OutboxWatch:
    """Start at NATS's kill, `returned()` when NATS is back, `wait()` for every outbox to be empty again. Its
    thread writes `figures`; `returned()` only each one's `num_sent_at_return`, before the thread reads it."""

    def __init__(self, mesh: Mesh, interval_s: float = 0.25) -> None:
        self.mesh = mesh
        self.interval_s = interval_s
        self.figures: dict[str, OutboxFigures] = {}  # by "<process>/<outbox>"
        self._returned_at: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> OutboxWatch:
        for key, (pending, peak, _) in self._read().items():
            self.figures[key] = OutboxFigures(peak_at_kill=peak, num_peak=int(pending))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def returned(self) -> None:
        """NATS is back: the replay starts."""
        readings = self._read()
        for key, figures in self.figures.items():
            if key in readings:
                figures.num_sent_at_return = int(readings[key][2])
        self._returned_at = time.monotonic()

    def wait(self, timeout_s: float) -> dict[str, dict[str, Any]]:
        """Until every outbox is empty after NATS's return (up to `timeout_s`); the figures by outbox."""
        self._done.wait(timeout_s)
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        return {
            key: {
                "num_peak": f.num_peak,
                "num_replayed": f.num_replayed,
                "drained_s": None if f.drained_s is None else round(f.drained_s, 2),
            }
            for key, f in sorted(self.figures.items())
        }

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            readings = self._read()
            returned_at = self._returned_at
            for key, figures in self.figures.items():
                if key not in readings:  # its process is gone (killed during the outage)
                    continue
                pending, peak, sent = readings[key]
                if figures.drained_s is not None:
                    continue
                # a peak gauge that rose since the kill is this outage's peak, exactly; polls may miss it
                figures.num_peak = max(figures.num_peak, int(pending), int(peak) if peak > figures.peak_at_kill else 0)
                if returned_at is not None and pending == 0:
                    figures.drained_s = time.monotonic() - returned_at
                    figures.num_replayed = int(sent) - figures.num_sent_at_return
            if returned_at is not None and all(
                f.drained_s is not None or key not in readings for key, f in self.figures.items()
            ):
                self._done.set()

    def _read(self) -> dict[str, tuple[float, float, float]]:
        """(messages waiting, peak, sent) of each outbox of each live process, by "<process>/<outbox>"."""
        readings: dict[str, tuple[float, float, float]] = {}
        for child in self.mesh.children:
            if child.role not in OUTBOX_ROLES or child.process.poll() is not None:
                continue
            try:
                lines = metric_lines(child.http_port, None)
            except (OSError, urllib.error.URLError):
                continue
            values: dict[str, dict[str, float]] = {}
            for line in lines:
                match = _SAMPLE.match(line)
                if match:
                    values.setdefault(match.group(2), {})[match.group(1)] = float(match.group(3))
            for outbox, value in values.items():
                readings[f"{child.name}/{outbox}"] = (
                    value.get("kvmesh_outbox_messages", 0.0),
                    value.get("kvmesh_outbox_messages_peak", 0.0),
                    value.get("kvmesh_outbox_messages_sent", 0.0),
                )
        gateway = self.mesh.child("gateway-0")
        if gateway.process.poll() is None:
            try:
                port, key = gateway.http_port, self.mesh.admin_key
                queued = metric_total(port, "kvmesh_gateway_usage_records_queued", key=key)
                sent = metric_total(port, "kvmesh_gateway_usage_records_published_total", key=key)
                readings["gateway-0/usage"] = (queued, 0.0, sent)
            except (OSError, urllib.error.URLError):
                pass
        return readings


async def replayed_kv_index(mesh: Mesh) -> GlobalKVIndex:
    """The global KV index as the KVMESH_KV stream has it: a fresh follower's, replayed from the stream."""
    bus = await Bus.connect(mesh.nats_url, "kv-index-check", tls=mesh.nats_tls)
    try:
        index = GlobalKVIndex()
        follower = KVEventFollower(bus, index)
        await follower.start()
        assert await follower.wait_caught_up(timeout_s=20)
        await follower.stop()
        return index
    finally:
        await bus.close()


def kv_index_agrees(mesh: Mesh) -> bool:
    """The store node kvcache-0 holds what the stream says it holds, and every live balancer's index (which
    followed the stream through whatever happened to NATS) has every block the stream has."""
    index = asyncio.run(replayed_kv_index(mesh))
    held = metric_sample(mesh.child("kvcache-0").http_port, "kvmesh_kvcache_blocks", 'tier="host"')
    balancers = [c.http_port for c in mesh.children if c.role == "balancer" and c.process.poll() is None]
    indexed = {metric_total(port, "kvmesh_kv_index_blocks") for port in balancers}
    return (index.num_blocks("kvcache-0"), {index.num_blocks()}) == (held, indexed)
