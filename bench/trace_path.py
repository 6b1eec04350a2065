"""Where a request's time to first token goes, from its spans: a mesh of `kvmesh bench serve`'s shape (one prefill,
one decode, one KV store, the balancers and gateway as processes) exports every span to a receiver in this
process; N requests are sent one at a time (C=1), each with new words, and each request's trace is cut into the
stages on the way to its first token. Prints one JSON object on stdout: per stage the median over requests (ms).

    .venv/bin/python bench/trace_path.py [--requests 16] [--model deepseek-tiny] [--max-tokens 16]

Stages, from the gateway's root span's start (the HTTP request parsed) on the wall clock all processes share:
  before_route      the gateway's work before asking the balancer (key, admission, template, tokens)
  route             Balancer/Route's SERVER span
  route_to_prefill  Route's end to PrefillStream's start: the gateway's hand-off and the gRPC hop
  before_compute    PrefillStream's start to the compute's: the device cache's lookup, admission, a store read
  compute           the compute span (the engine's steps up to the first token)
  outside_spans     the client's TTFT less the above: the client's and the gateway's HTTP, the first token's way
                    back from prefill through the gateway to the client
The mesh overhead `kvmesh bench serve` reports is TTFT less the prefill engine's own time (server-timing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

import aiohttp  # noqa: E402

from kvmesh.bench.otlp_sink import OTLPSink, ReceivedSpan  # noqa: E402
from kvmesh.bench.serve import API_KEY, Sample, make_prompts, one_request, start_mesh  # noqa: E402


def _stages(spans: list[ReceivedSpan], sample: Sample) -> dict[str, float]:
    named = {s.name: s for s in spans}
    root = next(s for s in spans if s.parent_id == "" or s.name.startswith("chat "))
    route, prefill = named["kvmesh.v1.Balancer/Route"], named["kvmesh.v1.Prefill/PrefillStream"]
    compute = named["kvmesh.prefill.compute"]
    stages = {
        "before_route": route.start_s - root.start_s,
        "route": route.duration_s,
        "route_to_prefill": prefill.start_s - (route.start_s + route.duration_s),
        "before_compute": compute.start_s - prefill.start_s,
        "compute": compute.duration_s,
    }
    stages["outside_spans"] = sample.ttft_s - (compute.start_s + compute.duration_s - root.start_s)
    stages["ttft"] = sample.ttft_s
    stages["prefill_engine"] = sample.prefill_s
    stages["mesh_overhead"] = sample.ttft_s - sample.prefill_s
    return {key: value * 1000 for key, value in stages.items()}


async def _send(url: str, model: str, num_requests: int, max_tokens: int) -> list[Sample]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for prompt in make_prompts(4, 64, seed=-1):  # warm-up: lazy paths loaded, connections open
            await one_request(session, url, API_KEY, model, prompt, max_tokens)
        await asyncio.sleep(1.0)
        return [
            await one_request(session, url, API_KEY, model, prompt, max_tokens)
            for prompt in make_prompts(num_requests, 64, seed=7)
        ]


def run(num_requests: int, model: str, max_tokens: int) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(OTLPSink())
        url = start_mesh(stack, model, 1, API_KEY, sink.exporter_env())
        started = time.time()
        samples = asyncio.run(_send(url, model, num_requests, max_tokens))
        time.sleep(6.0)  # the batch processors' next exports (every 5 s)
        by_trace: dict[str, list[ReceivedSpan]] = {}
        for span in sink.spans():
            by_trace.setdefault(span.trace_id, []).append(span)
    roots = sorted(
        (s for spans in by_trace.values() for s in spans if s.name.startswith("chat ") and s.start_s > started),
        key=lambda s: s.start_s,
    )[-num_requests:]  # the measured requests, in the order they were sent
    rows = [_stages(by_trace[root.trace_id], sample) for root, sample in zip(roots, samples, strict=True)]
    return {
        "model": model,
        "requests": num_requests,
        "median_ms": {key: round(statistics.median(r[key] for r in rows), 2) for key in rows[0]},
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--model", default="deepseek-tiny")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    print(json.dumps(run(args.requests, args.model, args.max_tokens)))


if __name__ == "__main__":
    main()
