"""CPU time tracing costs one request, with the exporter on and off: the spans a streamed chat makes in every role
(gateway, balancer, prefill, kvcache, decode; 12 spans, their attributes, the traceparent carried between them,
16 token batches on decode's stream, a log line per role), made by mesh.tracing's own helpers in one process and
exported over OTLP/gRPC to an in-process receiver (kvmesh.bench.otlp_sink). Prints one JSON object on stdout.

    .venv/bin/python bench/trace_cpu.py [--requests 2000] [--repeats 5] [--batches 16] [--consumer-spans 0]

  --consumer-spans N   the balancers' CONSUMER spans per request (mesh.bus.traced): 0 as the mesh makes them now
                       (their bookkeeping subscriptions are untraced); 4 as it made them before (two balancers, each
                       hearing the other's assignment for Route or BindDecode and both hearing requests.finished)

  off_us, on_us        CPU of the thread making the request's spans, per request (median over repeats); on - off is
                       what tracing adds to the request path
  export_us            CPU of the batch processor's thread (OTLP encoding and the export call), per request: not on
                       the request path, but on the same cores
  overhead_us          on_us - off_us + export_us: tracing's CPU per request in all
  num_spans_per_request, and the parenting of one exported request checked against the tree a real mesh makes

Thread CPU time (time.thread_time; the exporter thread's from /proc/self/task/<tid>/schedstat), not wall time, so
the figures move little on a loaded machine. One process plays every role, so a span's `kvmesh.worker_id` and
resource are the bench's; what each role does per span is as in services/*.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

import grpc  # noqa: E402

from kvmesh.bench.otlp_sink import OTLPSink  # noqa: E402
from mesh import rpc, tracing  # noqa: E402
from services.decode import server as decode_server  # noqa: E402
from services.decode.decoder import TokenBatch  # noqa: E402
from services.decode.server import trace_batch  # noqa: E402

MODEL = "deepseek-tiny"
CLIENT_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
NUM_SPANS = 16  # at most, per request: the queue is sized for it


class _Context:
    """What the tracing interceptor reads of a gRPC servicer context: the call's metadata."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class _Details:
    """What the interceptor reads of a call's details: its method."""

    def __init__(self, method: str) -> None:
        self.method = method


def _server(method: str, streaming: bool, body: Any) -> Any:
    """A gRPC method handler wrapped by the tracing interceptor, as the server installs it."""
    if streaming:

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            for item in body(request):
                yield item

        handler = grpc.unary_stream_rpc_method_handler(stream)
    else:

        async def unary(request: Any, context: Any) -> Any:
            return body(request)

        handler = grpc.unary_unary_rpc_method_handler(unary)
    return tracing.ServerTracing(is_public=False), method, handler


def _log(role: str) -> MutableMapping[str, Any]:
    return tracing.add_trace_ids(None, "info", {"event": f"{role} done"})


def _route(request: Any) -> int:
    _log("balancer")
    return 1


def _kv_get(traceparent: str) -> None:
    """kvcache: a lane exchange's SERVER span and the read's attributes (services/kvcache/server.py trace_read)."""
    with tracing.span("kvmesh.v1.KVCache/Get", tracing.SpanKind.SERVER, {"rpc.system": "kvmesh.lane"},
                      tracing.context_of(traceparent)) as span:  # fmt: skip
        if span.is_recording():
            read = {"kvmesh.kv.num_blocks.host": 4, "kvmesh.kv.num_blocks_asked": 4, tracing.BYTES_MOVED: 4 << 20}
            span.set_attributes(read)
        _log("kvcache")


def _push_kv(traceparent: str) -> None:
    """decode: the push lane's SERVER span (services/decode/lane.py)."""
    with tracing.span("kvmesh.v1.Decode/PushKV", tracing.SpanKind.SERVER, {"rpc.system": "kvmesh.lane"},
                      tracing.context_of(traceparent)):  # fmt: skip
        tracing.current_span().set_attribute(tracing.BYTES_MOVED, 4 << 20)


def _bind() -> None:
    """prefill: the late binding's call, and the balancer's SERVER span for it (services/prefill/prefiller.py)."""
    attributes = {"kvmesh.num_kv_tokens": 300, "kvmesh.decode.bind_at": "admission"}
    with tracing.span("kvmesh.decode.bind", attributes=attributes) as binding:
        rpc_attributes = {"rpc.system": "grpc", "rpc.service": "kvmesh.v1.Balancer", "rpc.method": "BindDecode"}
        with tracing.span("kvmesh.v1.Balancer/BindDecode", tracing.SpanKind.SERVER, rpc_attributes,
                          tracing.context_from(dict(rpc.metadata("r")))):  # fmt: skip
            _log("balancer")
        binding.set_attribute("kvmesh.decode_worker_id", "decode-0")


def _read_attributes(kind: str, num_blocks: int) -> dict[str, Any]:
    return {"kvmesh.kv.read": kind, "kvmesh.kv.num_blocks_asked": num_blocks}


def _prefill(request: Any) -> Iterator[int]:
    """prefill: the reads, the compute, the push (services/prefill/prefiller.py, server.py)."""
    with tracing.span("kvmesh.kv.read device", attributes=_read_attributes("lookup", 4)) as reading:
        reading.set_attribute("kvmesh.kv.num_blocks", 1)
    decision = {f"kvmesh.kv.fetch.{key}": 1.0 for key in ("predicted_fetch_s", "predicted_recompute_s", "queue_s")}
    tracing.current_span().set_attributes({"kvmesh.kv.fetch.choice": "fetch", **decision})
    with tracing.span("kvmesh.prefill.compute") as computing:
        with tracing.span("kvmesh.kv.read store", attributes=_read_attributes("stream", 3)) as reading:
            _kv_get(tracing.traceparent())
            reading.set_attribute("kvmesh.kv.num_blocks", 3)
            reading.set_attribute(tracing.BYTES_MOVED, 3 << 20)
        computing.set_attribute("kvmesh.num_computed_tokens", 40)
    _bind()
    with tracing.span("kvmesh.kv.push", attributes={"kvmesh.decode_worker_id": "decode-0"}) as pushing:
        _push_kv(tracing.traceparent())
        pushing.set_attribute(tracing.BYTES_MOVED, 4 << 20)
    span = tracing.current_span()
    if span.is_recording():
        span.set_attributes(
            {
                tracing.GEN_AI_MODEL: MODEL,
                tracing.GEN_AI_INPUT_TOKENS: 300,
                f"{tracing.CACHED_TOKENS}.device": 16,
                f"{tracing.CACHED_TOKENS}.store": 244,
                tracing.BYTES_MOVED: 4 << 20,
            }
        )
    _log("prefill")
    yield 1


def _stream(num_batches: int) -> Any:
    def body(request: Any) -> Iterator[int]:
        span = tracing.current_span()
        for index in range(num_batches):
            last = index == num_batches - 1
            batch = TokenBatch([7], [], "length" if last else None, index + 1)
            trace_batch(span, batch, index == 0)
            yield index
        if hasattr(decode_server, "trace_end"):  # since trace_end: count and finish reason once, at the end
            decode_server.trace_end(span, batch)
        _log("decode")

    return body


def _consumed(headers: dict[str, str], num_spans: int) -> None:
    """The balancers hearing a request's events (assignments, kvmesh.requests.finished), each in a CONSUMER span
    (mesh.bus.traced): `num_spans` of them."""
    from mesh.bus import traced

    for _ in range(num_spans):
        with traced(headers, "kvmesh.requests.finished"):
            pass


async def _call(server: Any, metadata: tuple[tuple[str, str], ...]) -> None:
    interceptor, method, handler = server

    async def continuation(details: Any) -> Any:
        return handler

    details = _Details(method)
    traced = await interceptor.intercept_service(continuation, details)
    context = _Context(metadata)
    if traced.unary_stream is not None:
        async for _ in traced.unary_stream(None, context):
            pass
    else:
        await traced.unary_unary(None, context)


async def _request(servers: dict[str, Any], num_consumer_spans: int) -> None:
    """gateway: the request's root span (services/gateway/rest.py, telemetry.py), the calls it makes."""
    attributes = {"http.request.method": "POST", "http.route": "/v1/chat/completions", tracing.REQUEST_ID: "r"}
    parent = tracing.context_from({tracing.TRACEPARENT: CLIENT_TRACEPARENT})
    with tracing.span("POST /v1/chat/completions", tracing.SpanKind.SERVER, attributes, parent):
        root = tracing.current_span()
        if root.is_recording():
            root.update_name(f"chat {MODEL}")
            root.set_attributes(
                {
                    tracing.GEN_AI_OPERATION: "chat",
                    tracing.GEN_AI_SYSTEM: tracing.SYSTEM,
                    tracing.GEN_AI_MODEL: MODEL,
                    tracing.TENANT: "default",
                }
            )
        await _call(servers["route"], rpc.metadata("r"))
        await _call(servers["prefill"], rpc.metadata("r"))
        await _call(servers["stream"], rpc.metadata("r"))
        _consumed({"x-request-id": "r", **tracing.headers()}, num_consumer_spans)
        root.set_attributes(
            {
                "kvmesh.status_code": 200,
                tracing.GEN_AI_INPUT_TOKENS: 300,
                tracing.GEN_AI_OUTPUT_TOKENS: 16,
                tracing.CACHED_TOKENS: 260,
                tracing.GEN_AI_FINISH_REASONS: ["length"],
                "kvmesh.prefill_worker_id": "prefill-0",
                "kvmesh.decode_worker_id": "decode-0",
                "kvmesh.num_migrations": 0,
                "http.response.status_code": 200,
            }
        )
        _log("gateway")


def _servers(num_batches: int) -> dict[str, Any]:
    return {
        "route": _server("/kvmesh.v1.Balancer/Route", False, _route),
        "prefill": _server("/kvmesh.v1.Prefill/PrefillStream", True, _prefill),
        "stream": _server("/kvmesh.v1.Decode/Stream", True, _stream(num_batches)),
    }


def _calls_per_request(num_batches: int, num_consumer_spans: int, num_requests: int = 20) -> float:
    """Python and C function calls one request makes (sys.setprofile): CPU's deterministic proxy."""
    servers = _servers(num_batches)
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    async def requests() -> None:
        sys.setprofile(profile)
        for _ in range(num_requests):
            await _request(servers, num_consumer_spans)
        sys.setprofile(None)

    asyncio.run(requests())
    return count[0] / num_requests


async def _requests_cpu_us(num_requests: int, num_batches: int, num_consumer_spans: int) -> float:
    servers = _servers(num_batches)
    started = time.thread_time()
    for _ in range(num_requests):
        await _request(servers, num_consumer_spans)
    return (time.thread_time() - started) / num_requests * 1e6


def _check_tree(sink: OTLPSink) -> dict[str, Any]:
    """One exported request's spans, parented as a real mesh's (tests/integration/test_tracing.py)."""
    trace_id = CLIENT_TRACEPARENT.split("-")[1]
    spans = sink.spans(trace_id)
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if s.name == f"chat {MODEL}")
    mine = [s for s in spans if _root_of(s, by_id) is root]
    names = {s.name: s for s in mine}
    parents = {name: by_id[s.parent_id].name if s.parent_id in by_id else s.parent_id for name, s in names.items()}
    return {"num_spans": len(mine), "parents": parents, "root_attributes": dict(sorted(root.attributes.items()))}


def _root_of(span: Any, by_id: dict[str, Any]) -> Any:
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
    return span


def run(num_requests: int, repeats: int, num_batches: int, num_consumer_spans: int = 0) -> dict[str, Any]:
    tracing.shutdown_tracing()
    shape = (num_batches, num_consumer_spans)
    off = statistics.median(asyncio.run(_requests_cpu_us(num_requests, *shape)) for _ in range(repeats))
    off_calls = _calls_per_request(*shape)
    measures = [_traced_cpu_us(num_requests, *shape) for _ in range(repeats)]
    on = statistics.median(m[0] for m in measures)
    export = statistics.median(m[1] for m in measures)
    return {
        "num_requests": num_requests,
        "repeats": repeats,
        "num_batches": num_batches,
        "num_consumer_spans": num_consumer_spans,
        "off_calls": off_calls,
        "on_calls": measures[0][4],
        "off_us": round(off, 1),
        "on_us": round(on, 1),
        "export_us": round(export, 1),
        "overhead_us": round(on - off + export, 1),
        "num_spans_per_request": measures[0][2] / num_requests,
        "tree": measures[0][3],
        "load_average": round(os.getloadavg()[0], 1),
    }


def _traced_cpu_us(
    num_requests: int, num_batches: int, num_consumer_spans: int
) -> tuple[float, float, int, dict[str, Any], float]:
    """With the exporter on: the request path's CPU per request; the export's (the batch processor's thread, which
    wakes at each full batch, and the flush of the rest on this thread after the timing; not gRPC's own I/O
    threads); the spans exported; one request's tree."""
    saved = dict(os.environ)
    with OTLPSink() as sink:
        os.environ.update(sink.exporter_env())
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "3600000"  # the processor's thread exports at each full batch
        os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(max(2048, num_requests * NUM_SPANS * 2))
        try:
            tracing.configure_tracing("bench", "bench-0")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        (exporter,) = [t for t in threading.enumerate() if t.name.startswith("OtelBatch")]
        before = _schedstat_s(exporter.native_id)
        on = asyncio.run(_requests_cpu_us(num_requests, num_batches, num_consumer_spans))
        flushing = time.thread_time()
        tracing._State.provider.force_flush()  # what is still queued, exported on this thread
        flush_s = time.thread_time() - flushing
        export = (_schedstat_s(exporter.native_id) - before + flush_s) / num_requests * 1e6
        num_exported = len(sink.spans())  # each export returns once the receiver has taken it
        calls = _calls_per_request(num_batches, num_consumer_spans)
        tracing.shutdown_tracing()
        return on, export, num_exported, _check_tree(sink), calls


def _schedstat_s(tid: int | None) -> float:
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=16, help="token batches on decode's stream")
    parser.add_argument("--consumer-spans", type=int, default=0, help="the balancers' CONSUMER spans per request")
    args = parser.parse_args()
    print(json.dumps(run(args.requests, args.repeats, args.batches, args.consumer_spans)))


if __name__ == "__main__":
    main()
