"""The faults themselves, on a mesh started by `kvmesh up`'s launcher, and `kvmesh bench faults`, which runs them
all in turn and prints the figures (tests/faults/ runs the same ones, shorter, and asserts the goals).

    suite = FaultSuite(mesh, load, api_key)
    suite.sigkill("decode")              # the decode worker serving the most streams, under load
    suite.sigterm_during_stream("prefill")
    suite.client_disconnect()            # seconds until every decode worker holds no KV
    suite.slow_decode(0.75)              # a decode worker stopped 75% of the time (SIGSTOP, SIGCONT)
    suite.stopped_decode()               # a decode worker stopped outright (SIGSTOP) until it is measured
    suite.nats_outage(10.0)

Every worker the suite kills, or stops under load, is started again at once (without waiting: the next fault on
the same role waits for it), so those faults find two replicas of each role.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvmesh.bench.faults import (
    FaultResult,
    ProbeStream,
    is_ready,
    measure,
    metric_sample,
    metric_total,
    percentile,
    replace,
    wait_for,
    wait_until_serving,
)
from kvmesh.bench.load import Load, Outcome
from kvmesh.bench.outboxes import OutboxWatch, kv_index_agrees
from kvmesh.nats_server import EmbeddedNats

if TYPE_CHECKING:
    from kvmesh.up import Mesh

API_KEY = "sk-kvmesh-bench"  # the key of the mesh the bench starts itself
MODEL = "deepseek-tiny"  # takes images, so the encoder pool is on the request path
# prefill first: a prefill worker killed while it pushes KV to decode gets its decode worker blamed too (the
# gateway excludes both), which fails the request when the other decode worker is down (a decode victim's
# replacement still starting)
ROLES = ("prefill", "decode", "kvcache", "encoder", "balancer", "expert_lb")
SLOW_DECODE_EJECTION_S = 10.0  # how long the gateway keeps a slow decode worker out of routing (its first time)
# the least window of the slow-decode fault: the gateway's detection takes half its 5 s window of samples and
# more (6.2 s in one run on the busy test machine, at 436 ms a token; 12.5 s in a full suite on 2026-12-07, when
# a 12 s window closed before any request could be seen avoiding it), then requests must be seen avoiding it
SLOW_DECODE_OBSERVE_S = 20.0
# a live worker on this busy CPU misses 0.25 s deadlines: both replicas of a role were ejected at once in the
# suite's runs (503 "no workers serve ... right now"); a dead one's port refuses at once, whatever the deadline
HEALTH_CHECK_TIMEOUT_S = 2.0
# a stopped worker answers no check: ejected after 3 (KVMESH_EJECT_AFTER_FAILURES) rounds of checks that each wait
# out the deadline, one every KVMESH_HEALTH_CHECK_INTERVAL_S (0.5 s) at most
STOPPED_EJECTION_S = 3 * (HEALTH_CHECK_TIMEOUT_S + 0.5)


def mesh_plan_args() -> dict[str, Any]:
    """The mesh every fault runs on: two of each role a request passes through, one KV store, the rebalancer."""
    return dict(
        prefill=2,
        decode=2,
        kvcache=1,
        balancer=2,
        encoder=2,
        models=(MODEL,),
        env={
            "KVMESH_HEARTBEAT_INTERVAL_S": "0.5",
            "KVMESH_EXPERT_REPORT_STEPS": "16",  # the workers report expert loads: expert_lb runs
            "KVMESH_KV_CACHE_MEMORY_BYTES": str(64 * 2**20),
            "KVMESH_HEALTH_CHECK_TIMEOUT_S": str(HEALTH_CHECK_TIMEOUT_S),
            "KVMESH_SLOW_DECODE_EJECTION_S": str(SLOW_DECODE_EJECTION_S),  # the default, said so the notes agree
        },
    )


class FaultSuite:
    def __init__(self, mesh: Mesh, load: Load, api_key: str, observe_s: float = 3.0, probe_tokens: int = 16) -> None:
        self.mesh = mesh
        self.load = load
        self.api_key = api_key
        self.observe_s = observe_s
        self.probe_tokens = probe_tokens
        self.quiet_since_s = 0.0  # when the last fault's window ended (measure's baseline starts there)

    def measure(self, name: str, inject: Callable[[], None], observe_s: float) -> FaultResult:
        result = measure(self.load, name, inject, observe_s, self.quiet_since_s)
        self.quiet_since_s = time.monotonic()
        return result

    def replicas(self, role: str) -> list[str]:
        return sorted(c.name for c in self.mesh.children if c.role == role and c.process.poll() is None)

    def wait_role_serving(self, role: str) -> None:
        for name in self.replicas(role):
            child = self.mesh.child(name)
            if not is_ready(child.http_port):
                wait_until_serving(child)

    def victim(self, role: str) -> tuple[str, int]:
        """The replica to hit, and how many of the load's requests in flight it serves: for decode the one
        serving the most streams (waiting up to 5 s for one that has begun), for prefill the one the latest
        request went to, otherwise replica 0."""
        header = {"decode": "decode_worker", "prefill": "prefill_worker"}.get(role)
        if header is None:
            return f"{role}-0", 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            serving = Counter(getattr(o, header) for o in self.load.in_flight() if o.token_times_s)
            if serving:
                return serving.most_common(1)[0]
            time.sleep(0.02)
        return self.replicas(role)[0], 0

    def sigkill(self, role: str) -> FaultResult:
        """SIGKILL one replica of `role` under load; it is started again once the fault is measured."""
        self.wait_role_serving(role)
        name, num_streams = self.victim(role)
        result = self.measure(f"SIGKILL {role}", lambda: self.mesh.kill(name), self.observe_s)
        result.notes = {"victim": name, "streams_on_victim": num_streams}
        replace(self.mesh, name, wait=False)
        return result

    def sigterm_during_stream(self, role: str, under_load: bool = True) -> tuple[FaultResult, ProbeStream]:
        """SIGTERM the replica of `role` serving a probe stream (decode, prefill: the one it went to; else
        replica 0); the probe must end whole. `under_load`: with the load running, and the replica started again
        once it has drained; otherwise with the load paused, so that it may be the role's last replica (the
        stream's drain is all that is asked), and it is not started again."""
        needed = sorted({"decode", "prefill", "balancer", role})  # the probe passes through these
        wait_for(lambda: all(self.num_serving(r) > 0 for r in needed), 180, "a worker of each role", 0.25)
        # and the gateway routes to them (a replica started again is in its pools a heartbeat after it serves)
        wait_for(lambda: is_ready(self.mesh.child("gateway-0").http_port), 30, "the gateway ready", 0.25)
        if under_load:
            self.wait_role_serving(role)
        else:
            self.load.pause()
        probe = ProbeStream(self.mesh.base_url, self.api_key, MODEL, self.probe_tokens)
        stopped: list[str] = []

        def inject() -> None:
            # tokens from decode already flowing: between prefill's push and the gateway's Decode.Stream call
            # a SIGTERMed decode worker refuses the call (docs/reliability.md)
            probe.start(min_chunks=4)
            header = probe.headers.get(f"x-kvmesh-{role}-worker")
            name = header if role in ("decode", "prefill") and header else self.replicas(role)[0]
            self.mesh.child(name).process.send_signal(signal.SIGTERM)
            stopped.append(name)

        if under_load:
            result = self.measure(f"SIGTERM {role} mid-stream", inject, self.observe_s)
        else:
            inject()
            probe.wait()
            result = FaultResult(f"SIGTERM {role} mid-stream (load paused)", 1, int(not probe.is_whole), 0.0)
            self.load.resume()
        probe.wait()
        result.notes = {"victim": stopped[0], "probe_whole": probe.is_whole, "probe_error": probe.error}
        if under_load:
            self.mesh.child(stopped[0]).process.wait(timeout=60)
            replace(self.mesh, stopped[0], wait=False)
        return result, probe

    def num_serving(self, role: str) -> int:
        return sum(is_ready(self.mesh.child(name).http_port) for name in self.replicas(role))

    def sigterm_gateway_during_stream(self) -> ProbeStream:
        """SIGTERM the (only) gateway with a stream open and the load paused: the stream ends whole. The gateway
        is not started again (the last fault of a run); the load stays paused."""
        self.load.pause()
        probe = ProbeStream(self.mesh.base_url, self.api_key, MODEL, self.probe_tokens).start(min_chunks=4)
        self.mesh.child("gateway-0").process.send_signal(signal.SIGTERM)
        probe.wait()
        self.mesh.child("gateway-0").process.wait(timeout=60)
        return probe

    def client_disconnect(self) -> tuple[float, float]:
        """(KV tokens the stream held on its decode worker, seconds from the client hanging up until no decode
        worker holds any KV) with the load paused, so that the KV is the stream's alone."""
        self.load.pause()
        try:
            probe = ProbeStream(self.mesh.base_url, self.api_key, MODEL, 2000).start(min_chunks=4)
            port = self.mesh.child(probe.headers["x-kvmesh-decode-worker"]).http_port
            held = wait_for_value(lambda: metric_total(port, "kvmesh_decode_kv_tokens"), 5)
            probe.close()
            freed_s = wait_for(lambda: self.decode_kv_tokens() == 0, 30, "every decode worker to free its KV")
        finally:
            self.load.resume()
        return held, freed_s

    def decode_kv_tokens(self) -> float:
        ports = [self.mesh.child(name).http_port for name in self.replicas("decode")]
        return sum(metric_total(port, "kvmesh_decode_kv_tokens") for port in ports)

    def slow_decode(self, duty: float = 0.75, name: str = "decode-0") -> FaultResult:
        """A throttled decode worker: stopped (SIGSTOP) for `duty` of every 200 ms, as a starved or throttled
        process is, for the window. The gateway is to eject it from routing (its streams' token gaps against the
        other worker's, mesh/latency_outliers.py) and move its late streams. Notes (slow_decode_notes): when the
        gateway ejected it (its kvmesh_gateway_decode_ejections_total, read every 0.25 s), the worker's share of
        the requests before and while it was out, the streams migrated for slowness, and their TPOTs."""
        self.wait_role_serving("decode")
        for replica in self.replicas("decode"):  # every one in the routes: none still out for an earlier slowness
            self.wait_routed_to(replica)
        pid = self.mesh.child(name).process.pid
        stop = threading.Event()
        ejected_at_s: list[float] = []
        num_ejections = self.gateway_metric("kvmesh_gateway_decode_ejections_total", 'reason="latency"')
        num_migrations = self.gateway_metric("kvmesh_gateway_migrations_total", 'reason="slow"')

        def throttle() -> None:
            while not stop.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.2 * duty)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.2 * (1 - duty))

        def watch_ejections() -> None:
            while not stop.is_set() and not ejected_at_s:
                if self.gateway_metric("kvmesh_gateway_decode_ejections_total", 'reason="latency"') > num_ejections:
                    ejected_at_s.append(time.monotonic())
                stop.wait(0.25)

        threads = [threading.Thread(target=run, daemon=True) for run in (throttle, watch_ejections)]

        streams_on_slow: list[Outcome] = []

        def inject() -> None:
            streams_on_slow.extend(o for o in self.load.in_flight() if o.decode_worker == name)
            for thread in threads:
                thread.start()

        start = time.monotonic()
        try:
            observe_s = max(3 * self.observe_s, SLOW_DECODE_OBSERVE_S)
            result = self.measure(f"slow decode ({duty:.0%} stopped)", inject, observe_s)
        finally:
            stop.set()
            for thread in threads:
                if thread.ident is not None:
                    thread.join()
        window = [o for o in self.load.outcomes() if o.started_s >= start and o.is_ok]
        result.notes = slow_decode_notes(window, name, start, ejected_at_s[0] if ejected_at_s else None)
        num_slow = self.gateway_metric("kvmesh_gateway_migrations_total", 'reason="slow"') - num_migrations
        result.notes["num_migrated_for_slowness"] = int(num_slow)
        result.notes["streams_on_slow_worker_at_fault"] = len(streams_on_slow)
        return result

    def stopped_decode(self) -> FaultResult:
        """A decode worker stopped outright (SIGSTOP) under load until `observe_s` after every balancer ejected
        it, then continued (SIGCONT). It sends no token, so the gateway's latency rule has nothing to judge: only
        failed health checks (no answer within KVMESH_HEALTH_CHECK_TIMEOUT_S, mesh.health) eject it, from every
        balancer's pool and the gateway's, and its streams, once silent for as long as those checks took (the
        gateway's unrouted stall limit), move to the other worker. Notes: the victim and the streams it held,
        seconds until every balancer's pool left it out and until the first migration, how long it was stopped,
        seconds from SIGCONT until every pool had it back, and the gateway's migrations meanwhile."""
        self.wait_role_serving("decode")
        for replica in self.replicas("decode"):  # every one in the routes: none still out for an earlier fault
            self.wait_routed_to(replica)
        name, num_streams = self.victim("decode")
        pid = self.mesh.child(name).process.pid
        pools_before = self.decode_pool_sizes()
        smaller = [n - 1 for n in pools_before]
        notes: dict[str, Any] = {"victim": name, "streams_on_victim": num_streams}
        num_migrations = self.num_migrations()
        stopped_at_s = resumed_at_s = time.monotonic()

        def resume() -> None:
            nonlocal resumed_at_s
            os.kill(pid, signal.SIGCONT)
            if "stopped_s" not in notes:
                resumed_at_s = time.monotonic()
                notes["stopped_s"] = round(resumed_at_s - stopped_at_s, 2)

        def inject() -> None:
            nonlocal stopped_at_s
            os.kill(pid, signal.SIGSTOP)
            stopped_at_s = time.monotonic()
            ejected_after_s = wait_for(lambda: self.decode_pool_sizes() == smaller, 30, f"{name} ejected")
            notes["ejected_after_s"] = round(ejected_after_s, 2)
            if num_streams:  # its streams move once silent for as long as the checks took (STOPPED_EJECTION_S)
                with contextlib.suppress(TimeoutError):
                    wait_for(lambda: self.num_migrations() > num_migrations, 2 * STOPPED_EJECTION_S, "a migration")
                    notes["migrated_after_s"] = round(time.monotonic() - stopped_at_s, 2)
            threading.Timer(self.observe_s, resume).start()  # what it held is moved by then, or waits for it

        try:
            result = self.measure("SIGSTOP decode", inject, self.observe_s)
        finally:
            resume()
        wait_for(lambda: self.decode_pool_sizes() == pools_before, 30, f"{name} back in the pools")
        notes["back_after_sigcont_s"] = round(time.monotonic() - resumed_at_s, 2)  # measure's wait may add to it
        notes["num_migrated"] = int(self.num_migrations() - num_migrations)
        result.notes = notes
        return result

    def num_migrations(self) -> float:
        """The gateway's migrations so far, for any cause."""
        port = self.mesh.child("gateway-0").http_port
        return metric_total(port, "kvmesh_gateway_migrations_total", key=self.mesh.admin_key)

    def wait_routed_to(self, name: str, timeout_s: float = 2 * SLOW_DECODE_EJECTION_S + 10) -> None:
        """Until a request of the load sent from now on is routed to `name` (raises TimeoutError)."""
        since_s = time.monotonic()

        def is_routed() -> bool:
            sent = self.load.in_flight() + self.load.outcomes()
            return any(o.started_s >= since_s and o.decode_worker == name for o in sent)

        wait_for(is_routed, timeout_s, f"a request routed to {name}", interval_s=0.1)

    def gateway_metric(self, metric: str, labels: str) -> float:
        """One sample of the gateway's /metrics (its public port: the admin key's)."""
        port = self.mesh.child("gateway-0").http_port
        return metric_sample(port, metric, labels, key=self.mesh.admin_key)

    def nats_outage(self, seconds: float, kill_during: str | None = None) -> FaultResult:
        """SIGKILL the embedded NATS under load and start it again on its port and store after `seconds`.
        `kill_during`: a worker to SIGKILL 2 s into the outage, as a worker that really dies while NATS is away
        (started again once NATS is back). Notes: each balancer's decode pool 2 s into the outage (nobody is
        pruned for the heartbeats NATS did not carry), with a victim the seconds until every balancer ejected it
        (gRPC health checks, mesh.health), and each outbox's peak size, replay and seconds to drain (outboxes.py)."""
        nats = self.mesh.nats
        assert isinstance(nats, EmbeddedNats) and nats.process is not None, "the mesh's own NATS, one server"
        restarted = threading.Event()
        notes: dict[str, Any] = {}
        outboxes = OutboxWatch(self.mesh)

        def restart() -> None:
            nats.start()
            outboxes.returned()
            restarted.set()

        def inject() -> None:
            assert nats.process is not None
            pools_before = self.decode_pool_sizes()
            outboxes.start()
            nats.process.kill()
            nats.process.wait()
            threading.Timer(seconds, restart).start()
            time.sleep(2.0)
            notes["decode_pools_before"], notes["decode_pools_2s_in"] = pools_before, self.decode_pool_sizes()
            if kill_during is not None:
                self.mesh.kill(kill_during)
                smaller = [n - 1 for n in pools_before]
                ejected_after_s = wait_for(lambda: self.decode_pool_sizes() == smaller, 10, f"{kill_during} ejected")
                notes.update(victim=kill_during, ejected_after_s=round(ejected_after_s, 2))

        result = self.measure(f"NATS down {seconds:.0f} s", inject, seconds + self.observe_s)
        restarted.wait(timeout=30)
        notes["outboxes"] = outboxes.wait(timeout_s=60)  # before the victim's replacement takes its name
        if kill_during is not None:
            replace(self.mesh, kill_during)  # serving again before the next fault: it may hit another role
        result.notes = notes
        return result

    def decode_pool_sizes(self) -> list[float]:
        """The size of the decode pool at each live balancer, in name order."""
        ports = [self.mesh.child(name).http_port for name in self.replicas("balancer")]
        return [metric_sample(port, "kvmesh_balancer_workers", 'pool="decode"') for port in ports]


def slow_decode_notes(window: list[Outcome], name: str, start_s: float, ejected_at_s: float | None) -> dict[str, Any]:
    """What a slow decode worker did to the requests started in the fault's window (whole ones): its share of them
    before it was ejected and while it was out (SLOW_DECODE_EJECTION_S from `ejected_at_s`, less a second), and
    the TPOT p50 of the streams it served against the others', and the p99 of those sent while it was out."""

    def share(outcomes: list[Outcome]) -> float | None:
        on_slow = sum(o.decode_worker == name for o in outcomes)
        return round(on_slow / len(outcomes), 3) if outcomes else None

    def tpots(outcomes: list[Outcome]) -> list[float]:
        return [t for o in outcomes if (t := o.tpot_s) is not None]

    # less a second: the watcher sees the ejection up to a poll and a scrape after it, so it ends that much sooner
    out_until_s = -1.0 if ejected_at_s is None else ejected_at_s + SLOW_DECODE_EJECTION_S - 1.0
    before = [o for o in window if ejected_at_s is None or o.started_s < ejected_at_s]
    while_out = [o for o in window if ejected_at_s is not None and ejected_at_s <= o.started_s < out_until_s]
    return {
        "victim": name,
        "ejected_after_s": None if ejected_at_s is None else round(ejected_at_s - start_s, 2),
        "share_on_slow_worker": share(window),
        "share_before_ejection": share(before),
        "share_while_ejected": share(while_out),
        "num_requests_while_ejected": len(while_out),
        "tpot_p50_ms_slow": _ms(percentile(tpots([o for o in window if o.decode_worker == name]), 0.5)),
        "tpot_p50_ms_others": _ms(percentile(tpots([o for o in window if o.decode_worker != name]), 0.5)),
        "tpot_p99_ms_while_ejected": _ms(percentile(tpots(while_out), 0.99)),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def wait_for_value(read: Callable[[], float], timeout_s: float) -> float:
    """The first non-zero value `read()` returns within `timeout_s` (the gauges are exported every heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"still 0 after {timeout_s:.0f}s")
        time.sleep(0.05)
    return value


# `kvmesh bench faults`


def add_parser(bench_commands: Any) -> None:
    faults = bench_commands.add_parser("faults", help="kill, stop and slow each role under load: failed, recovery")
    faults.add_argument("--concurrency", type=int, default=4, help="streams in flight")
    faults.add_argument("--observe-s", type=float, default=6.0, help="seconds of load after each fault")
    faults.add_argument("--nats-outage-s", type=float, default=10.0, help="0: leave NATS alone")
    faults.add_argument("--slow-duty", type=float, default=0.75, help="share of the time the slow worker is stopped")
    faults.add_argument("--only", default=",".join(FAULTS), help=f"some of {','.join(FAULTS)} (default all)")
    faults.add_argument("--json", action="store_true", help="one line of JSON")


FAULTS = ("slow", "stopped", "disconnect", "sigkill", "sigterm", "nats", "gateway")  # in the order a run takes them


def run(args: argparse.Namespace) -> int:
    only = set(args.only.split(","))
    if not only <= set(FAULTS):
        raise SystemExit(f"--only takes some of {','.join(FAULTS)}, not {args.only!r}")
    if args.nats_outage_s <= 0:
        only.discard("nats")
    result = run_fault_bench(args.concurrency, args.observe_s, args.nats_outage_s, args.slow_duty, only)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def run_fault_bench(
    concurrency: int, observe_s: float, nats_outage_s: float, slow_duty: float, only: set[str]
) -> dict[str, Any]:
    from kvmesh.nats_server import free_port
    from kvmesh.up import Mesh, MeshPlan

    with contextlib.ExitStack() as stack:
        plan = MeshPlan(http_port=free_port(), grpc_port=free_port(), api_keys=(API_KEY,), **mesh_plan_args())
        mesh = Mesh(plan, out=stack.enter_context(open(os.devnull, "w")))
        stack.callback(mesh.stop)
        mesh.start()
        mesh.wait_ready()
        wait_for(lambda: all(is_ready(c.http_port) for c in mesh.children), 180, "every child ready", 0.25)
        time.sleep(1.5)
        load = Load(mesh.base_url, API_KEY, MODEL, concurrency, kinds=("chat", "image"), max_tokens=16).start()
        stack.callback(load.stop)
        time.sleep(observe_s)  # a baseline before the first fault
        suite = FaultSuite(mesh, load, API_KEY, observe_s=observe_s)
        results: list[FaultResult] = []
        extra: dict[str, Any] = {}
        if "nats" in only:  # first, while the store node the index is checked against is the first one
            results.append(suite.nats_outage(nats_outage_s))
            try:
                agreed_s = wait_for(lambda: kv_index_agrees(mesh), 60, "the KV index to agree", interval_s=1.0)
                results[-1].notes["kv_index_agrees_after_s"] = round(agreed_s, 2)
            except TimeoutError:
                results[-1].notes["kv_index_agrees_after_s"] = None
        if "slow" in only:
            results.append(suite.slow_decode(slow_duty))
        if "stopped" in only:
            results.append(suite.stopped_decode())
        if "disconnect" in only:
            held, freed_s = suite.client_disconnect()
            extra["client_disconnect"] = {"kv_tokens_held": held, "kv_freed_s": round(freed_s, 2)}
        if "sigkill" in only:
            results += [suite.sigkill(role) for role in ROLES]
        if "sigterm" in only:
            results += [suite.sigterm_during_stream(role)[0] for role in ROLES]
        if "gateway" in only:
            extra["sigterm_gateway_stream_whole"] = suite.sigterm_gateway_during_stream().is_whole
    return {
        "model": MODEL,
        "load_average": [round(x, 1) for x in os.getloadavg()],  # at the end: the machine's, over 1, 5, 15 min
        "concurrency": concurrency,
        "observe_s": observe_s,
        "faults": [r.figures() for r in results],
        **extra,
        "num_failed": sum(r.num_failed for r in results),
        "num_requests": sum(r.num_requests for r in results),
    }
