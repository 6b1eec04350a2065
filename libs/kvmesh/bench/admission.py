"""`kvmesh bench admission`: what tenant limits cost a request (services/gateway/tenancy/limits.py).

Against its own EmbeddedNats, 1 and then 3 limiters (each its own NATS connection, as gateway replicas have)
share one key's and one tenant's counters, in two modes side by side: `allowances` (the default: most decisions
in memory, from room drawn ahead of need) and `per_request` (allowances off: every admission and settlement a
compare-and-set per scope, which is also what a tight limit gets in the default mode):
- latency: each limiter (its own process) runs requests one after another; per request, the time to reserve and
  then settle (p50, p99), i.e. what admission adds to a request;
- throughput: `--concurrency` requests in flight over the limiters; admission decisions per second, each one
  settled.
`store_writes_per_decision`: compare-and-sets on the store per decision (lost ones included). The throughput
run's limiters share this one process (one event loop), so their Python work queues behind each other's: an
upper bound on what separate replicas would see. Only JSON goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from kvmesh.nats_server import EmbeddedNats

GOAL_P99_MS = 2.0
GOAL_DECISIONS_PER_S = 2000.0
PROMPT_TOKENS = 200
MAX_TOKENS = 256
WARM_REQUESTS = 20  # per replica, not measured
USED_TOKENS = PROMPT_TOKENS + 100  # what settlement charges: the rest of the reservation comes back


def add_parser(bench_commands: Any) -> None:
    admission = bench_commands.add_parser(
        "admission", help="tenant limits: admission + settlement cost (p50, p99) and decisions/s, 1 and 3 replicas"
    )
    admission.add_argument("--requests", type=int, default=2000, help="requests per limiter in the latency run")
    admission.add_argument("--pace-ms", type=float, default=10.0, help="each replica's pause between requests")
    admission.add_argument("--decisions", type=int, default=6000, help="admission decisions in the throughput run")
    admission.add_argument("--concurrency", type=int, default=32, help="requests in flight in the throughput run")
    admission.add_argument("--smoke", action="store_true", help="a few requests: checks that it runs")
    admission.add_argument("--json", action="store_true", help="one line of JSON")


def run(args: argparse.Namespace) -> int:
    requests, decisions = (50, 200) if args.smoke else (args.requests, args.decisions)
    result = asyncio.run(run_admission_bench(requests, decisions, args.concurrency, args.pace_ms / 1000))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def run_admission_bench(num_requests: int, num_decisions: int, concurrency: int, pace_s: float) -> dict[str, Any]:
    from services.gateway.tenancy.limits import ALLOWANCE_REQUESTS

    results = []
    with EmbeddedNats() as server:
        for num_limiters in (1, 3):
            for mode, allowance in (("allowances", ALLOWANCE_REQUESTS), ("per_request", 0)):
                args = (server.url, num_limiters, num_requests, pace_s, allowance, mode)
                latency = await asyncio.to_thread(_latency, *args)
                throughput = await _throughput(server.url, num_limiters, num_decisions, concurrency, allowance, mode)
                results.append({"mode": mode, "num_limiters": num_limiters, **latency, **throughput})
    default = [r for r in results if r["mode"] == "allowances"]
    return {
        "bench": "admission",
        "scopes": ["key", "tenant"],
        "limits": "requests, tokens per minute, day and month, concurrency: each scope one KV entry, one CAS",
        "goal_p99_ms": GOAL_P99_MS,
        "goal_decisions_per_s": GOAL_DECISIONS_PER_S,
        "results": results,
        "meets_goals": all(
            r["admit_settle_p99_ms"] < GOAL_P99_MS and r["decisions_per_s"] >= GOAL_DECISIONS_PER_S for r in default
        ),
    }


async def _limiters(url: str, num_limiters: int, bucket: str, allowance: int) -> tuple[list[Any], list[Any]]:
    import nats

    from services.gateway.tenancy.limits import Limiter

    clients = [await nats.connect(url, name=f"bench-admission-{i}") for i in range(num_limiters)]
    limiters = [Limiter(client, bucket=bucket, allowance_requests=allowance) for client in clients]
    for limiter in limiters:
        limiter.start()
    return clients, limiters


async def _close(clients: list[Any], limiters: list[Any]) -> None:
    """As a gateway stops: each limiter's settlements written and its watch stopped, then the connections (a
    watch left on a closed connection kept asyncio.run from ending in one of four runs)."""
    for limiter in limiters:
        await limiter.stop()
    for client in clients:
        await client.close()


def _principal(tag: str) -> Any:
    from services.gateway.tenancy.principal import Limits, Principal

    roomy = Limits(
        requests_per_minute=10**9,
        tokens_per_minute=10**12,
        max_concurrent=10**6,
        tokens_per_day=10**13,
        tokens_per_month=10**14,
    )
    return Principal(f"ten_{tag}", tag, f"key_{tag}", tag, tenant_limits=roomy, key_limits=roomy)


def _latency(
    url: str, num_limiters: int, num_requests: int, pace_s: float, allowance: int, mode: str
) -> dict[str, Any]:
    """Each limiter in its own process (as replicas are), requests one after another, `pace_s` apart."""
    context = multiprocessing.get_context("spawn")
    tag = f"latency{num_limiters}{mode}"
    with ProcessPoolExecutor(num_limiters, mp_context=context) as pool:
        runs = [
            pool.submit(_latency_samples, url, tag, str(i), num_requests, pace_s, allowance)
            for i in range(num_limiters)
        ]
        samples = [run.result() for run in runs]
    reserve_s = [sample for run in samples for sample in run[0]]
    total_s = [sample for run in samples for sample in run[1]]
    writes = sum(run[2] for run in samples)
    return {
        "num_requests": len(total_s),
        "pace_ms": pace_s * 1000,
        "latency_store_writes_per_decision": round(writes / len(total_s), 3),
        "admit_settle_p50_ms": round(_percentile(total_s, 0.5) * 1000, 3),
        "admit_settle_p99_ms": round(_percentile(total_s, 0.99) * 1000, 3),
        "admit_p50_ms": round(_percentile(reserve_s, 0.5) * 1000, 3),
        "admit_p99_ms": round(_percentile(reserve_s, 0.99) * 1000, 3),
    }


def _latency_samples(
    url: str, tag: str, name: str, num_requests: int, pace_s: float, allowance: int
) -> tuple[list[float], list[float], int]:
    return asyncio.run(_latency_loop(url, tag, name, num_requests, pace_s, allowance))


async def _latency_loop(
    url: str, tag: str, name: str, num_requests: int, pace_s: float, allowance: int
) -> tuple[list[float], list[float], int]:
    from services.gateway.tenancy.limit_counters import Demand

    clients, [limiter] = await _limiters(url, 1, "BENCH_LATENCY", allowance)
    principal = _principal(tag)
    reserve_s: list[float] = []
    total_s: list[float] = []
    try:
        for number in range(-WARM_REQUESTS, num_requests):  # the first open the bucket and fill the cache
            if number == 0:
                writes_before = limiter.store_writes
            started = time.perf_counter()
            reservation = await limiter.reserve(principal, Demand(f"r{name}-{number}", PROMPT_TOKENS, MAX_TOKENS))
            reserved = time.perf_counter()
            await limiter.settle(reservation, USED_TOKENS)
            if number >= 0:
                reserve_s.append(reserved - started)
                total_s.append(time.perf_counter() - started)
            await asyncio.sleep(pace_s)
        writes = limiter.store_writes - writes_before
    finally:
        await _close(clients, [limiter])
    return reserve_s, total_s, writes


async def _throughput(
    url: str, num_limiters: int, num_decisions: int, concurrency: int, allowance: int, mode: str
) -> dict[str, Any]:
    from services.gateway.tenancy.limit_counters import Demand

    clients, limiters = await _limiters(url, num_limiters, f"BENCH_THROUGHPUT_{num_limiters}_{mode}", allowance)
    principal = _principal(f"throughput{num_limiters}{mode}")
    numbers = iter(range(num_decisions))

    async def worker(index: int) -> None:
        limiter = limiters[index % num_limiters]
        for number in numbers:  # shared: the workers take the decisions between them
            reservation = await limiter.reserve(principal, Demand(f"t{number}", PROMPT_TOKENS, MAX_TOKENS))
            await limiter.settle(reservation, USED_TOKENS)

    try:
        for limiter in limiters:  # warm
            await limiter.settle(await limiter.reserve(principal, Demand("warm", 1, 1)), 1)
        writes_before = sum(limiter.store_writes for limiter in limiters)
        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
        writes = sum(limiter.store_writes for limiter in limiters) - writes_before
    finally:
        await _close(clients, limiters)
    return {
        "concurrency": concurrency,
        "num_decisions": num_decisions,
        "decisions_per_s": round(num_decisions / elapsed, 1),
        "throughput_store_writes_per_decision": round(writes / num_decisions, 3),
    }
