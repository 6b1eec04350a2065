"""`kvmesh bench spans`: what one span costs a kvmesh process, in the CPU time of the thread that makes it (not
wall time, so the figure holds on a loaded machine; not the process's, which counts the receiver's threads): a
span with two attributes and its traceparent injected into a call's metadata, as mesh.tracing makes them, with
tracing off (a flag check) and on (the SDK, queued to the batch processor); and the OTLP encoding of a finished
span, which the batch processor's thread does before export. A request makes about ten spans across its
processes (`kvmesh bench serve --trace` reports how many).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from kvmesh.bench.otlp_sink import OTLPSink
from mesh import rpc, tracing


def _span_cpu_us(num_spans: int) -> float:
    started = time.thread_time()
    for _ in range(num_spans):
        with tracing.span("bench", attributes={tracing.GEN_AI_MODEL: "m"}) as span:
            span.set_attribute(tracing.BYTES_MOVED, 1)
            rpc.metadata("request")
    return (time.thread_time() - started) / num_spans * 1e6


def _encode_cpu_us(num_spans: int) -> float:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("bench")
    for _ in range(num_spans):
        with tracer.start_as_current_span("bench", attributes={tracing.GEN_AI_MODEL: "m", tracing.WORKER_ID: "w"}):
            pass
    spans = memory.get_finished_spans()
    started = time.thread_time()
    encode_spans(spans).SerializeToString()
    return (time.thread_time() - started) / len(spans) * 1e6


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_span_bench(num_spans: int = 5000, repeats: int = 5) -> dict[str, Any]:
    tracing.shutdown_tracing()
    off = statistics.median(_span_cpu_us(num_spans) for _ in range(repeats))
    with OTLPSink() as sink:
        # the batch processor holds every span until shutdown, so its export does not run inside the timing
        held = {
            "OTEL_BSP_SCHEDULE_DELAY": "3600000",
            "OTEL_BSP_MAX_QUEUE_SIZE": str(max(2048, num_spans * (repeats + 1))),
        }
        with _environment({**sink.exporter_env(), **held, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "512"}):
            tracing.configure_tracing("bench", "bench-0")
            try:
                on = statistics.median(_span_cpu_us(num_spans) for _ in range(repeats))
            finally:
                tracing.shutdown_tracing()
        num_exported = len(sink.spans())
    encode = statistics.median(_encode_cpu_us(num_spans) for _ in range(repeats))
    return {
        "num_spans": num_spans,
        "repeats": repeats,
        "off_cpu_us_per_span": round(off, 2),
        "on_cpu_us_per_span": round(on, 2),
        "encode_cpu_us_per_span": round(encode, 2),
        "num_exported": num_exported,
    }
