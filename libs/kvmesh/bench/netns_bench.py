"""`kvmesh bench netns`: time to first token and prefill's KV push on one small mesh (one prefill, decode, KV store
and balancer) whose roles are separate hosts (kvmesh.netns: network namespaces on a bridge), first on a clean
network, then with `tc netem` delay and loss between the prefill and decode hosts only; beside the same mesh on
loopback.

Each phase sends `num_requests` streamed chats one after another (one unmeasured first), every prompt new (a
unique first block: no cache hit anywhere), each with a W3C traceparent of its own, so the prefill worker's
`kvmesh.kv.push` span (export, then push over decode's bulk lane, until decode has taken it all) is found by trace
id in an OTLP receiver run here. TTFT is the client's: request sent to first content chunk. Prints one JSON
object: medians per phase, the netem phase over the clean one, and the TCP connect time between the two hosts
under each (the impairment holds: about 2 x delay). Where the kernel has no netem (kvmesh.netns.netem_unavailable)
the netem phase is `{"skipped": why}`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvmesh.bench.otlp_sink import OTLPSink
from kvmesh.nats_server import free_port
from kvmesh.netns import Hosts, NetnsMesh, netem_unavailable
from kvmesh.up import Mesh, MeshPlan
from mesh.tracing import BYTES_MOVED

API_KEY = "sk-kvmesh-bench"
ROLES = {"prefill": 1, "decode": 1, "kvcache": 1, "balancer": 1, "encoder": 0}
FILLER = "the river carries silt past the old mill and the heron waits in the reeds for the evening"


def plan(model: str, env: dict[str, str]) -> MeshPlan:
    return MeshPlan(
        **ROLES,  # type: ignore[arg-type]
        models=(model,),
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=(API_KEY,),
        env={
            "KVMESH_HEARTBEAT_INTERVAL_S": "0.5",
            "KVMESH_LOG_FORMAT": "json",
            "KVMESH_HEALTH_CHECK_TIMEOUT_S": "2.0",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            **env,
        },
    )


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def start_serving(mesh: Mesh, timeout_s: float = 300.0) -> None:
    """Start the mesh and wait until the gateway and every child are ready, and a few heartbeats went round."""
    mesh.start()
    mesh.wait_ready(timeout_s)
    deadline = time.monotonic() + timeout_s
    while not all(is_ready(f"http://{mesh.child_host(c.name)}:{c.http_port}/readyz") for c in mesh.children):
        if time.monotonic() > deadline:
            raise TimeoutError("not every child of the mesh became ready")
        time.sleep(0.25)
    time.sleep(1.5)  # three heartbeats: every worker in the balancer's pools


def prompt(number: int, num_words: int) -> str:
    """A prompt whose first words are new (no block of it is cached anywhere) and about `num_words` long."""
    words = FILLER.split()
    body = " ".join(words[i % len(words)] for i in range(num_words))
    return f"Request {secrets.token_hex(4)}-{number}: {body}. Summarise."


def streamed_ttft(base_url: str, model: str, text: str, trace_id: str, timeout_s: float = 120.0) -> float:
    """Seconds from sending a streamed chat to its first content chunk (the rest is read and dropped)."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": True}
    ).encode()
    headers = {
        "Authorization": f"Bearer {API_KEY}",
        "Content-Type": "application/json",
        "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
    }
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", body, headers)
    started = time.perf_counter()
    ttft: float | None = None
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if ttft is None and line.startswith("data: {") and '"content"' in line:
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("the stream carried no content")
    return ttft


def push_spans(sink: OTLPSink, trace_ids: list[str], timeout_s: float = 15.0) -> list[tuple[float, int]]:
    """(seconds, bytes) of each trace's `kvmesh.kv.push` span, waiting for the batch exporters to deliver."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {s.trace_id: s for s in sink.spans() if s.name == "kvmesh.kv.push" and s.trace_id in trace_ids}
        if len(found) == len(trace_ids) or time.monotonic() > deadline:
            return [(s.duration_s, int(s.attributes.get(BYTES_MOVED, 0))) for s in found.values()]
        time.sleep(0.2)


def measure(mesh: Mesh, sink: OTLPSink, model: str, num_requests: int, num_words: int) -> dict[str, Any]:
    streamed_ttft(mesh.base_url, model, prompt(-1, num_words), secrets.token_hex(16))  # warm-up, not counted
    ttfts, trace_ids = [], []
    for number in range(num_requests):
        trace_id = secrets.token_hex(16)
        ttfts.append(streamed_ttft(mesh.base_url, model, prompt(number, num_words), trace_id))
        trace_ids.append(trace_id)
    pushes = push_spans(sink, trace_ids)
    return {
        "num_requests": num_requests,
        "ttft_ms_p50": round(statistics.median(ttfts) * 1000, 1),
        "ttft_ms_max": round(max(ttfts) * 1000, 1),
        "kv_push_ms_p50": round(statistics.median(s for s, _ in pushes) * 1000, 2) if pushes else None,
        "kv_push_ms_max": round(max(s for s, _ in pushes) * 1000, 2) if pushes else None,
        "kv_push_bytes_p50": int(statistics.median(b for _, b in pushes)) if pushes else None,
        "num_push_spans": len(pushes),
    }


def loopback_phase(model: str, num_requests: int, num_words: int, log: Path) -> dict[str, Any]:
    with OTLPSink() as sink, log.open("w") as out:
        mesh = Mesh(plan(model, sink.exporter_env()), out=out)
        try:
            start_serving(mesh)
            return measure(mesh, sink, model, num_requests, num_words)
        finally:
            mesh.stop()


def netns_phases(
    model: str, num_requests: int, num_words: int, delay_ms: float, loss_pct: float, log: Path
) -> dict[str, Any]:
    with Hosts() as hosts, OTLPSink(hosts.address) as sink, log.open("w") as out:
        mesh = NetnsMesh(hosts, plan(model, sink.exporter_env()), out=out)
        try:
            start_serving(mesh)
            decode = mesh.child("decode-0")
            pair = ("prefill-0", "decode-0")

            def connect_ms() -> float:
                return round(hosts.connect_ms("prefill-0", mesh.child_host("decode-0"), decode.http_port), 2)

            clean = {**measure(mesh, sink, model, num_requests, num_words), "connect_ms": connect_ms()}
            reason = netem_unavailable()
            impaired: dict[str, Any] = {"skipped": reason}
            if reason is None:
                hosts.impair(*pair, delay_ms=delay_ms, loss_pct=loss_pct)
                impaired = {**measure(mesh, sink, model, num_requests, num_words), "connect_ms": connect_ms()}
                hosts.clear(*pair)
            return {"hosts": {n: h.address for n, h in hosts.hosts.items()}, "clean": clean, "netem": impaired}
        finally:
            mesh.stop()


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def run_netns_bench(
    model: str = "smollm2-135m",
    num_requests: int = 8,
    num_words: int = 300,
    delay_ms: float = 2.0,
    loss_pct: float = 0.1,
    loopback: bool = True,
) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="kvmesh-bench-netns-"))
    result: dict[str, Any] = {
        "model": model,
        "prompt_words": num_words,
        "netem": {"delay_ms": delay_ms, "loss_pct": loss_pct, "between": ["prefill-0", "decode-0"]},
        "logs": str(logs),
    }
    if loopback:
        result["loopback"] = loopback_phase(model, num_requests, num_words, logs / "loopback.log")
    netns = netns_phases(model, num_requests, num_words, delay_ms, loss_pct, logs / "netns.log")
    result.update(hosts=netns["hosts"], netns_clean=netns["clean"], netns_netem=netns["netem"])
    clean, impaired = netns["clean"], netns["netem"]
    if "skipped" not in impaired:
        result["netem_over_clean"] = {
            "ttft_p50": _ratio(impaired["ttft_ms_p50"], clean["ttft_ms_p50"]),
            "kv_push_p50": _ratio(impaired["kv_push_ms_p50"], clean["kv_push_ms_p50"]),
        }
    with contextlib.suppress(KeyError):
        result["netns_clean_over_loopback"] = {
            "ttft_p50": _ratio(clean["ttft_ms_p50"], result["loopback"]["ttft_ms_p50"]),
            "kv_push_p50": _ratio(clean["kv_push_ms_p50"], result["loopback"]["kv_push_ms_p50"]),
        }
    return result


def add_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "netns", help="TTFT and KV push across network namespaces, clean and with netem (root, iproute2)"
    )
    bench.add_argument("--model", default="smollm2-135m")
    bench.add_argument("--requests", type=int, default=8, help="measured requests per phase (after one warm-up)")
    bench.add_argument("--prompt-words", type=int, default=300, help="words per prompt (about 1.3 tokens each)")
    bench.add_argument("--delay-ms", type=float, default=2.0, help="netem delay each way between prefill and decode")
    bench.add_argument("--loss-pct", type=float, default=0.1, help="netem loss each way between prefill and decode")
    bench.add_argument("--no-loopback", action="store_true", help="skip the loopback mesh")
    bench.add_argument("--json", action="store_true", help="one line of JSON")


def run(args: Any) -> int:
    from kvmesh.netns import unavailable

    if args.requests < 1 or args.prompt_words < 1 or args.delay_ms < 0 or not 0 <= args.loss_pct <= 100:
        raise ValueError("--requests and --prompt-words must be positive, --delay-ms >= 0, --loss-pct 0 to 100")
    reason = unavailable()
    if reason is not None:
        raise ValueError(f"kvmesh bench netns: {reason}")
    result = run_netns_bench(
        args.model, args.requests, args.prompt_words, args.delay_ms, args.loss_pct, loopback=not args.no_loopback
    )
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
