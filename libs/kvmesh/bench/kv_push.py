"""`kvmesh bench kv-push`: prefill's KV push to a decode worker, over the bulk lane against Decode.PushKV.

Starts one decode worker (`kvmesh serve decode`, its own process, on an embedded NATS) and pushes the KV of a prompt
of each size with prefill's own pusher (services.prefill.decode_client), alternating the two transports: PushKV over
gRPC (the baseline) and the decode worker's bulk lane. A push is timed from the header to decode's answer, so it
includes decode reserving the blocks and writing every chunk into its cache (the same work on both transports); each
pushed request is aborted, and decode left a moment to end the step it was in, before the next push (a push's
reservation waits for a step boundary, which is the engine's time, not the transport's). The KV bytes are zeros in
the model's own layout, cut into chunks as prefill cuts them (`rpc.KV_CHUNK_BYTES`). Prints medians, GB/s and
`speedup` (gRPC time / lane time) per size.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engine_core import LLMEngine, SamplingParams
from engine_core.kv_cache.manager import cdiv
from engine_core.kv_transfer import KVChunk, KVExport
from kvmesh.certs import ProcessCertificates
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import lane, rpc
from mesh.bus import Bus
from mesh.compute.settings import WorkerSettings
from mesh.config import load_settings
from mesh.discovery import WorkerRegistry
from mesh.kv_blocks import KVLayout
from mesh.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.prefill.decode_client import DecodePusher
from services.prefill.prefiller import PrefillJob

TRANSPORTS = ("grpc", "lane")
SETTLE_S = 0.5  # after an abort: decode ends the step it was in and frees the blocks


def model_layout(model: str) -> KVLayout:
    """The model's KV layout, from an engine built here with a token cache (the decode worker builds the same)."""
    settings = load_settings(WorkerSettings, env={}, models=(model,), kv_cache_memory_bytes=8 * 2**20)
    return LLMEngine(settings.engine_config(model)).kv_layout


def zero_export(layout: KVLayout, num_tokens: int) -> tuple[KVExport, list[KVChunk]]:
    num_blocks = cdiv(num_tokens, layout.block_size)
    export = KVExport(
        layout,
        "",
        list(range(10, 10 + num_tokens)),
        [11],
        num_tokens,
        num_blocks,
        lambda layer, first, count: bytes(layout.chunk_bytes(count)),
    )
    return export, list(export.chunks(max_bytes=rpc.KV_CHUNK_BYTES))


async def _replay(chunks: list[KVChunk]) -> AsyncIterator[KVChunk]:
    for chunk in chunks:
        yield chunk


async def _decode_worker(nats_url: str) -> common_pb2.WorkerInfo:
    bus = await Bus.connect(nats_url, "bench-kv-push")
    registry = WorkerRegistry(bus, [common_pb2.ROLE_DECODE], 0.5)
    await registry.start()
    try:
        deadline = time.monotonic() + 300
        while not registry.workers():
            if time.monotonic() > deadline:
                raise TimeoutError("the decode worker did not announce itself within 300 s")
            await asyncio.sleep(0.1)
        return registry.workers()[0].info
    finally:
        await registry.stop()
        await bus.close()


async def _measure(
    worker: common_pb2.WorkerInfo,
    model: str,
    layout: KVLayout,
    sizes: list[int],
    repeats: int,
    certs: ProcessCertificates,
) -> dict[str, Any]:
    credentials = certs.credentials("prefill", "bench-prefill")  # only prefill may push KV
    channels = rpc.Channels(credentials)
    as_gateway = rpc.Channels(certs.credentials("gateway", "bench-gateway"))  # only the gateway may abort
    pusher = DecodePusher(channels, lane_tls=lane.client_tls(credentials))
    abort = decode_pb2_grpc.DecodeStub(as_gateway.get(worker.address)).Abort
    results: dict[str, Any] = {}
    try:
        for num_tokens in sizes:
            export, chunks = zero_export(layout, num_tokens)
            num_bytes = sum(len(chunk.data) for chunk in chunks)
            times: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
            for i in range(repeats + 1):  # the first round warms both paths (connections, allocator) and is dropped
                for transport in TRANSPORTS:
                    request_id = f"push-{num_tokens}-{transport}-{i}"
                    job = PrefillJob(
                        request_id,
                        model,
                        export.prompt_token_ids,
                        SamplingParams(max_tokens=2),
                        None,
                        worker.address,
                        worker.worker_id,
                        decode_data_address=worker.data_address if transport == "lane" else "",
                    )
                    started = time.perf_counter()
                    sent = await pusher.push(job, export, _replay(chunks))
                    elapsed = time.perf_counter() - started
                    await abort(decode_pb2.AbortRequest(request_id=request_id))
                    await asyncio.sleep(SETTLE_S)
                    assert sent == num_bytes, (sent, num_bytes)
                    if i:
                        times[transport].append(elapsed)
            medians = {t: statistics.median(times[t]) for t in TRANSPORTS}
            results[str(num_tokens)] = {
                "kv_bytes": num_bytes,
                **{f"{t}_s": round(medians[t], 4) for t in TRANSPORTS},
                **{f"{t}_gbps": round(num_bytes / medians[t] / 1e9, 3) for t in TRANSPORTS},
                "speedup": round(medians["grpc"] / medians["lane"], 2),
            }
    finally:
        pusher.close()
        await channels.close()
        await as_gateway.close()
    return results


def run_push_bench(
    model: str = "smollm2-135m", sizes: tuple[int, ...] = (2000, 8000), repeats: int = 5
) -> dict[str, Any]:
    layout = model_layout(model)
    kv_bytes = max(sizes) * layout.num_block_bytes // layout.block_size
    certs = ProcessCertificates(Path(tempfile.mkdtemp(prefix="kvmesh-bench-certs-")))  # mutual TLS, as deployed
    with EmbeddedNats() as nats:
        env = {
            **os.environ,
            "KVMESH_NATS_URL": nats.url,
            "KVMESH_MODELS": model,
            "KVMESH_WORKER_ID": "decode-bench",
            "KVMESH_HOST": "127.0.0.1",
            "KVMESH_GRPC_PORT": "0",
            "KVMESH_DATA_PORT": "0",
            "KVMESH_HTTP_PORT": str(free_port()),
            "KVMESH_LOG_LEVEL": "warning",
            "KVMESH_KV_CACHE_MEMORY_BYTES": str(2 * kv_bytes + 64 * 2**20),
            **certs.env("decode", "decode-bench"),
        }
        decode = subprocess.Popen(
            [sys.executable, "-m", "kvmesh", "serve", "decode"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            worker = asyncio.run(_decode_worker(nats.url))
            by_size = asyncio.run(_measure(worker, model, layout, list(sizes), repeats, certs))
        finally:
            decode.terminate()
            decode.wait(30)
            shutil.rmtree(certs.directory, ignore_errors=True)
    return {"model": model, "repeats": repeats, "chunk_bytes_max": rpc.KV_CHUNK_BYTES, "by_prompt_tokens": by_size}
