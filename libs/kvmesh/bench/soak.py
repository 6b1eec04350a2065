"""`kvmesh bench soak`: the mesh under a steady mixed load for minutes, then its errors, its latency over time and
each process's resident memory slope.

Traffic (load.py): `concurrency` clients, each sending in turn a streamed chat, a chat with a tool, a streamed
chat with an image and a stored Responses turn followed by a follow-up naming it (`previous_response_id`); every
request must come back whole (a stream ends with `[DONE]` and every token asked for). Errors are counted by kind
(http_503, connection, timeout, incomplete, ...) and by request kind. Latency goes in buckets of `bucket_s` (a
minute by default): requests, errors, p50 and p99 latency, p99 time per output token; the baseline is the run's
own first bucket (`latency_p50_last_vs_first`). Memory: every `sample_s` the VmRSS of each process of the mesh
(/proc/PID/status), and per process the least-squares slope in MB per minute over the run. The load runs
`warmup_s` before the run is measured, reported apart: a cold mesh fills its caches and compiles its grammars
then (a tool's grammar for deepseek-tiny's 129k-token vocabulary takes seconds per worker on a busy CPU), and
the first minute's allocations are not a leak.

Starts its own mesh (`kvmesh up`'s launcher: two balancers, two decode workers, one of each other role, NATS
embedded) unless --url names a running gateway; then memory is sampled only for the processes named by --pid.
Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

from kvmesh.bench.faults import percentile
from kvmesh.bench.load import KINDS, Load, Outcome

API_KEY = "sk-kvmesh-bench"  # the key of the mesh the bench starts itself
GOAL_MB_PER_MIN = 0.5  # issue 18: every service under 0.5 MB/min over an hour


def add_parser(bench_commands: Any) -> None:
    soak = bench_commands.add_parser("soak", help="mixed traffic for minutes: errors, latency over time, RSS slopes")
    soak.add_argument("--minutes", type=float, default=5.0, help="how long the load runs")
    soak.add_argument("--seconds", type=float, default=None, help="instead of --minutes (smoke runs)")
    soak.add_argument("--concurrency", type=int, default=16)
    soak.add_argument("--model", default="deepseek-tiny", help="a model that takes images (default deepseek-tiny)")
    soak.add_argument("--max-tokens", type=int, default=16, help="tokens per request (EOS ignored on streams)")
    soak.add_argument(
        "--warmup-s", type=float, default=60.0, help="load before the measured run (reported apart: cold caches)"
    )
    soak.add_argument("--bucket-s", type=float, default=60.0, help="latency buckets (default a minute)")
    soak.add_argument("--sample-s", type=float, default=5.0, help="memory sampling interval")
    soak.add_argument("--url", default=None, help="an already running gateway (default: start a mesh)")
    soak.add_argument(
        "--api-key",
        default=os.environ.get("KVMESH_API_KEY"),
        help="the gateway's API key (default: $KVMESH_API_KEY, else the key of the mesh started here)",
    )
    soak.add_argument("--pid", action="append", default=[], help="NAME=PID: a process to sample with --url")
    soak.add_argument("--json", action="store_true", help="one line of JSON")


def run(args: argparse.Namespace) -> int:
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    processes = dict(_pid(text) for text in args.pid)
    result = run_soak(
        seconds,
        args.concurrency,
        model=args.model,
        max_tokens=args.max_tokens,
        bucket_s=args.bucket_s,
        warmup_s=args.warmup_s,
        sample_s=args.sample_s,
        url=args.url,
        api_key=args.api_key,
        processes=processes,
    )
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _pid(text: str) -> tuple[str, int]:
    name, _, pid = text.partition("=")
    if not name or not pid.isdigit():
        raise SystemExit(f"--pid takes NAME=PID, not {text!r}")
    return name, int(pid)


def run_soak(
    seconds: float,
    concurrency: int,
    *,
    model: str = "deepseek-tiny",
    max_tokens: int = 16,
    bucket_s: float = 60.0,
    warmup_s: float = 0.0,
    sample_s: float = 5.0,
    url: str | None = None,
    api_key: str | None = None,
    processes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """`processes`: name -> pid to sample (the mesh started here: all of its own)."""
    with contextlib.ExitStack() as stack:
        if url is None:
            mesh = _start_mesh(stack, model, stack.enter_context(open(os.devnull, "w")))
            url, api_key = mesh.base_url, API_KEY
            processes = {c.name: c.process.pid for c in mesh.children}
            if mesh.nats is not None and mesh.nats.process is not None:
                processes["nats"] = mesh.nats.process.pid
        sampler = MemorySampler(processes or {}, sample_s)
        load = Load(url, api_key or API_KEY, model, concurrency, kinds=KINDS, max_tokens=max_tokens).start()
        sampler.start(time.monotonic() + warmup_s)  # sampled through the warm-up too, to show the whole curve
        time.sleep(warmup_s)
        start = time.monotonic()
        time.sleep(seconds)
        sampler.stop()
        load.stop()
    outcomes = load.outcomes()
    warmup = [o for o in outcomes if o.started_s < start]
    result = summarize([o for o in outcomes if o.started_s >= start], start, bucket_s, sampler, seconds)
    warmup_failed = [o for o in warmup if not o.is_ok]
    return {
        "model": model,
        "seconds": seconds,
        "concurrency": concurrency,
        "warmup": {
            "seconds": warmup_s,
            "num_requests": len(warmup),
            "errors_by_kind": dict(Counter(str(o.error) for o in warmup_failed)),
            "error_details": sorted({f"{o.kind} {o.error}: {o.detail}" for o in warmup_failed})[:5],
        },
        **result,
    }


def _start_mesh(stack: contextlib.ExitStack, model: str, out: IO[str]) -> Any:
    from kvmesh.nats_server import free_port
    from kvmesh.up import Mesh, MeshPlan

    plan = MeshPlan(
        prefill=1,
        decode=2,
        kvcache=1,
        balancer=2,
        encoder=1,
        models=(model,),
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=(API_KEY,),
        env={"KVMESH_LOG_LEVEL": "warning"},
    )
    mesh = Mesh(plan, out=out)
    stack.callback(mesh.stop)
    mesh.start()
    mesh.wait_ready()
    time.sleep(3.0)  # every worker's heartbeats reach both balancers
    return mesh


class MemorySampler:
    """VmRSS of each named process every `interval_s`, in a thread of its own (a process gone is skipped).
    Sample times count from the measured run's start: a warm-up's samples are negative, kept for the curve
    (`rss_mb_by_minute`) and left out of the slope."""

    def __init__(self, processes: dict[str, int], interval_s: float) -> None:
        self.processes = processes
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in processes}  # (s, MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def start(self, measured_from: float | None = None) -> None:
        """`measured_from`: the monotonic time the measured run starts (default now)."""
        self._start = time.monotonic() if measured_from is None else measured_from
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the end of the run is always a sample

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                return

    def _sample(self) -> None:
        now = time.monotonic() - self._start
        for name, pid in self.processes.items():
            mb = rss_mb(pid)
            if mb is not None:
                self.samples[name].append((now, mb))

    def figures(self) -> dict[str, dict[str, Any]]:
        figures: dict[str, dict[str, Any]] = {}
        for name, every in self.samples.items():
            samples = [(t, mb) for t, mb in every if t >= 0]
            slope, whole = slope_per_minute(samples), slope_per_minute(every)
            figures[name] = {
                "num_samples": len(samples),
                "rss_first_mb": round(samples[0][1], 1) if samples else None,
                "rss_last_mb": round(samples[-1][1], 1) if samples else None,
                "slope_mb_per_min": None if slope is None else round(slope, 3),
                "slope_with_warmup_mb_per_min": None if whole is None else round(whole, 3),
                "rss_mb_by_minute": by_minute(every),
            }
        return figures


def rss_mb(pid: int) -> float | None:
    """A process's resident set (VmRSS) in MB, or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # kB
    return None


def by_minute(samples: list[tuple[float, float]]) -> dict[str, float]:
    """The last sample of each whole minute, keyed by the minute (negative: the warm-up's), in MB."""
    last: dict[int, float] = {}
    for t, mb in samples:
        last[int(t // 60)] = mb
    return {str(minute): round(mb, 1) for minute, mb in sorted(last.items())}


def slope_per_minute(samples: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, MB) samples, in MB per minute (None with fewer than two)."""
    if len(samples) < 2:
        return None
    mean_t = statistics.fmean(t for t, _ in samples)
    mean_mb = statistics.fmean(mb for _, mb in samples)
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    if spread == 0:
        return None
    return 60 * sum((t - mean_t) * (mb - mean_mb) for t, mb in samples) / spread


def _bucket(outcomes: list[Outcome], index: int, bucket_s: float) -> dict[str, Any]:
    latencies = [o.latency_s for o in outcomes if o.is_ok]
    tpots = [t for o in outcomes if o.is_ok and (t := o.tpot_s) is not None]
    p50, p99, tpot99 = percentile(latencies, 0.5), percentile(latencies, 0.99), percentile(tpots, 0.99)
    return {
        "from_s": round(index * bucket_s, 1),
        "num_requests": len(outcomes),
        "num_errors": sum(not o.is_ok for o in outcomes),
        "latency_p50_s": None if p50 is None else round(p50, 3),
        "latency_p99_s": None if p99 is None else round(p99, 3),
        "tpot_p99_ms": None if tpot99 is None else round(tpot99 * 1000, 1),
    }


def summarize(
    outcomes: list[Outcome],
    start: float,
    bucket_s: float,
    sampler: MemorySampler,
    seconds: float,
) -> dict[str, Any]:
    """The run's figures: errors by kind, latency per bucket (by when a request ended), memory slopes. A
    request started in the run that ends after it (the load's last ones) goes in the last bucket."""
    num_buckets = max(1, int(-(-seconds // bucket_s)))
    by_bucket: list[list[Outcome]] = [[] for _ in range(num_buckets)]
    for outcome in outcomes:
        by_bucket[min(num_buckets - 1, int((outcome.ended_s - start) // bucket_s))].append(outcome)
    buckets = [_bucket(o, i, bucket_s) for i, o in enumerate(by_bucket)]
    memory = sampler.figures()
    slopes = [m["slope_mb_per_min"] for m in memory.values() if m["slope_mb_per_min"] is not None]
    first, last = buckets[0]["latency_p50_s"], buckets[-1]["latency_p50_s"]
    return {
        "num_requests": len(outcomes),
        "num_errors": sum(not o.is_ok for o in outcomes),
        "requests_by_kind": dict(Counter(o.kind for o in outcomes)),
        "errors_by_kind": dict(Counter(str(o.error) for o in outcomes if not o.is_ok)),
        "errors_by_request_kind": dict(Counter(o.kind for o in outcomes if not o.is_ok)),
        "error_details": [f"{o.kind} {o.error}: {o.detail}" for o in outcomes if not o.is_ok][:5],
        "buckets": buckets,
        "latency_p50_last_vs_first": round(last / first, 3) if first and last else None,
        "memory": memory,
        "max_slope_mb_per_min": round(max(slopes), 3) if slopes else None,
        "goal_zero_errors": all(o.is_ok for o in outcomes),
        "goal_slope_under_0_5_mb_per_min": bool(slopes) and max(slopes) < GOAL_MB_PER_MIN,
    }
