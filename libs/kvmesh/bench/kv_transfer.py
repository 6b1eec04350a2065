"""`kvmesh bench kv-transfer`: GB/s through the KV store over loopback against a raw TCP socket pushing the same bytes.

The store side is the real thing: a kvcache node in its own process (embedded NATS with JetStream), and this process
as a prefill worker (`StoreClient`: Put of whole blocks with their checksums; `fetch` through the global index, every
block checked against its checksum on arrival). The raw side is one TCP connection on loopback to a process that
reads into a buffer and acknowledges: the ceiling of a Python process pushing bytes on this machine. Measurements are
interleaved (store, then TCP, per repeat) so a burst of load elsewhere hits both; the best of each is reported.
`raw_tcp_same_memory_gbps` is raw TCP moving the bytes between the same memory as the lane: one 2 MiB block sent over
and over into one 8 MiB buffer stays in the CPU's caches, where the lane reads 256 MiB of distinct blocks and writes
each byte at its own place in the reader's buffers, so this raw side sends distinct copies of the blocks and reads
into a buffer the size of the transfer (reused across repeats, as the reader's buffer pool is); `ratio_same_memory`
is the store over it. `store_gbps` is the read path prefill uses (the layer-major stream through the global index
that feeds an engine while it computes, over the node's bulk lane, mesh.lane; every block checked; the engine's own
writes left out); `ratio` = store / raw. `store_grpc_stream_gbps` is the same stream over gRPC (KVCache.Get, what a
node without a lane answers). `store_fetch_gbps` is the other read path (whole blocks, over the lane; used without
the index or when parity must be decoded), `store_put_gbps` the write path (over the lane; every block checked by the
node, written to host memory, events acked by JetStream).

`cpu_s_per_256mib` is what each side spent on the CPU per 256 MiB moved (the median over repeats), a figure that
load elsewhere barely moves where GB/s halves: `store_reader` (this process, every thread, around the lane stream),
`store_node` (the node's process, every thread, from /proc), and the raw sides, `raw_sender` and `raw_reader`
(cached blocks) and `raw_same_memory_sender` and `raw_same_memory_reader`.

Protection (`--protection`, the `protection` field): `tls` (the default, as deployed) runs the node and the client
with a throwaway CA, so the lane is authenticated by mutual TLS and its frames sealed (AES-GCM), and `ratio` is the
protected lane over raw TCP; `mac` is the same with KVMESH_LANE_ENCRYPT=0 (payloads authenticated, not encrypted);
`none` runs both under KVMESH_INSECURE=1 (the plain lane). Either way the run also reports `raw_tls_gbps` (the raw
socket wrapped in TLS: the ceiling of TLS records in one Python process) and what one core hashes with the MACs a
lane could have used per block instead: `hmac_sha256_gbps` and `blake2b_keyed_gbps`, a cost both ends would pay
on every byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import multiprocessing
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from kvmesh.certs import ProcessCertificates
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import lane, rpc
from mesh.bus import Bus
from mesh.config import TLSSettings
from mesh.discovery import WorkerRegistry
from mesh.kv_blocks import KVLayout
from mesh.pb import common_pb2
from mesh.tls import client_ssl_context, load_credentials, server_ssl_context
from services.prefill.prefiller import StoreBlock
from services.prefill.store_client import StoreClient

MODEL = "bench"
CPU_UNIT_BYTES = 256 * 2**20  # cpu_s_per_256mib


def cpu_s_of(pid: int) -> float:
    """CPU seconds the process `pid` has run so far, every live thread of it (/proc/PID/task/*/schedstat, ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended since the listing
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


class CpuMeter:
    """CPU seconds of this process and of `peer` (another process) spent in each measured stretch."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.own_s: list[float] = []
        self.peer_s: list[float] = []

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        own, peer = time.process_time(), cpu_s_of(self.peer)
        yield
        self.own_s.append(time.process_time() - own)
        self.peer_s.append(cpu_s_of(self.peer) - peer)


def bench_layout(block_kib: int) -> KVLayout:
    """float16 KV of 16 tokens, 8 heads of 128, (k, v): 64 KiB per layer; layers make up the block size."""
    num_layers = max(1, block_kib // 64)
    return KVLayout(MODEL, "float16", 16, num_layers, (2, 1, 16, 8, 128), 1)


def _tcp_sink(port: int, ready: Any, tls_dir: str | None = None, buffer_bytes: int = 8 << 20) -> None:
    """Read what comes into a buffer of `buffer_bytes` (each push from its start), acknowledge each push; over TLS
    (as a kvcache node, a client certificate required) when `tls_dir` holds a node's certificate."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(1)
    ready.set()
    connection, _ = server.accept()
    if tls_dir is not None:
        credentials = load_credentials("kvcache", TLSSettings(tls_dir=tls_dir))
        assert credentials is not None
        connection = server_ssl_context(credentials).wrap_socket(connection, server_side=True)
    buffer = memoryview(bytearray(buffer_bytes))
    while True:
        header = bytearray()
        while len(header) < 8:  # TLS sockets take no MSG_WAITALL
            part = connection.recv(8 - len(header))
            if not part:
                return
            header += part
        remaining = int.from_bytes(header, "little")
        at = 0
        while remaining:
            received = connection.recv_into(buffer[at : at + min(len(buffer) - at, remaining)])
            if not received:
                return
            remaining -= received
            at = (at + received) % len(buffer)
        connection.sendall(b"k")


def _mac_gbps(data: bytes, repeats: int) -> tuple[float, float]:
    """(HMAC-SHA256, keyed BLAKE2b) GB/s of one core over `data`: the best of `repeats`."""
    key = os.urandom(32)
    hmac_s, blake_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        hmac.new(key, data, hashlib.sha256).digest()
        hmac_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        hashlib.blake2b(data, key=key).digest()
        blake_s.append(time.perf_counter() - started)
    return len(data) / min(hmac_s) / 1e9, len(data) / min(blake_s) / 1e9


def _tcp_push(connection: socket.socket, datas: list[bytes] | list[bytearray], cpu: CpuMeter | None = None) -> float:
    with cpu.measure() if cpu is not None else contextlib.nullcontext():
        started = time.perf_counter()
        connection.sendall(sum(len(data) for data in datas).to_bytes(8, "little"))
        for data in datas:
            connection.sendall(data)
        connection.recv(1)
        return time.perf_counter() - started


async def _stream(
    client: StoreClient, keys: list[bytes], layout: KVLayout, over_lanes: bool, cpu: CpuMeter | None = None
) -> float:
    client.use_lanes = over_lanes
    stream = client.plan_stream(MODEL, keys)
    assert stream is not None
    with cpu.measure() if cpu is not None else contextlib.nullcontext():
        started = time.perf_counter()
        assert await stream.run(layout, len(keys), lambda layer, pieces: None)
        elapsed = time.perf_counter() - started
    client.use_lanes = True
    return elapsed


async def _store_round(
    client: StoreClient, blocks: list[StoreBlock], round_id: int, cpu: CpuMeter | None = None
) -> tuple[float, float, float, float]:
    """(put, fetch, layer-stream over the lane, layer-stream over gRPC seconds) for fresh keys, so every Put
    stores and every read gets the whole chain."""
    fresh = [
        StoreBlock(round_id.to_bytes(4, "little") + b.block_hash[4:], b.parent_hash, b.layout, b.data) for b in blocks
    ]
    keys = [b.block_hash for b in fresh]
    started = time.perf_counter()
    await client.put(fresh)
    put_s = time.perf_counter() - started
    while client.index.num_leading_hits("kv-bench", keys) < len(keys):  # the node's events reached the index
        await asyncio.sleep(0.005)
    started = time.perf_counter()
    got = await client.fetch(MODEL, keys)
    fetch_s = time.perf_counter() - started
    assert len(got) == len(keys) and got[-1].data == fresh[-1].data, "the store did not give every block back"
    lane_s = await _stream(client, keys, blocks[0].layout, over_lanes=True, cpu=cpu)
    grpc_s = await _stream(client, keys, blocks[0].layout, over_lanes=False)
    return put_s, fetch_s, lane_s, grpc_s


def _raw_tls_client(certs: ProcessCertificates) -> ssl.SSLContext:
    credentials = load_credentials("prefill", TLSSettings(tls_dir=str(certs.issue("prefill", "kv-bench-raw"))))
    assert credentials is not None
    return client_ssl_context(credentials)


@contextlib.asynccontextmanager
async def store_client(
    nats_url: str, name: str, certs: ProcessCertificates, node: subprocess.Popen[bytes]
) -> AsyncIterator[StoreClient]:
    """A prefill worker's StoreClient (its own bus connection and mutual-TLS identity `<name>-client`), once the
    kvcache `node` (a process) is in its pool; everything it opened is closed on the way out."""
    bus = await Bus.connect(nats_url, name)
    registry = WorkerRegistry(bus, [common_pb2.ROLE_KVCACHE], 0.2)
    credentials = certs.credentials("prefill", f"{name}-client")
    channels = rpc.Channels(credentials)
    client = StoreClient(registry, channels, timeout_s=120.0, lane_tls=lane.client_tls(credentials))
    try:
        await registry.start()
        await client.start(bus)
        while not client.is_available():
            if node.poll() is not None:
                raise RuntimeError("the kvcache node exited")
            await asyncio.sleep(0.05)
        yield client
    finally:
        await client.stop()
        await registry.stop()
        await channels.close()
        await bus.close()


async def _run(megabytes: int, block_kib: int, repeats: int, protection: str) -> dict[str, Any]:
    layout = bench_layout(block_kib)
    num_block_bytes = layout.num_block_bytes
    num_blocks = max(1, megabytes * 2**20 // num_block_bytes)
    payload = os.urandom(num_block_bytes)
    blocks = [StoreBlock(n.to_bytes(32, "big"), b"\0" * 32, layout, payload) for n in range(num_blocks)]  # distinct
    total = num_blocks * num_block_bytes
    insecure = {"KVMESH_INSECURE": "1" if protection == "none" else "0"}
    encrypt = {"KVMESH_LANE_ENCRYPT": "0" if protection == "mac" else "1"}
    certs = ProcessCertificates(Path(tempfile.mkdtemp(prefix="kvmesh-bench-certs-")), insecure)
    with EmbeddedNats() as nats:
        env = {
            **os.environ,
            "KVMESH_NATS_URL": nats.url,
            "KVMESH_WORKER_ID": "kv-bench",
            "KVMESH_LOG_LEVEL": "warning",
            "KVMESH_CAPACITY_BYTES": str(total * (repeats + 2)),
            "KVMESH_HEARTBEAT_INTERVAL_S": "0.2",
            "KVMESH_HTTP_PORT": str(free_port()),
            **insecure,
            **encrypt,
            **certs.env("kvcache", "kv-bench"),
        }
        node = subprocess.Popen([sys.executable, "-m", "services.kvcache"], env=env)
        sinks, ports = [], []
        for tls_dir, buffer_bytes in (
            (None, 8 << 20),
            (str(certs.issue("kvcache", "kv-bench-sink")), 8 << 20),
            (None, total),
        ):
            ready = multiprocessing.Event()
            ports.append(free_port())
            sinks.append(
                multiprocessing.Process(target=_tcp_sink, args=(ports[-1], ready, tls_dir, buffer_bytes), daemon=True)
            )
            sinks[-1].start()
            ready.wait(10)
        try:
            async with store_client(nats.url, "kv-bench", certs, node) as client:
                sink_pids = [sink.pid for sink in sinks]
                assert None not in sink_pids
                raw = socket.create_connection(("127.0.0.1", ports[0]))
                raw_tls = _raw_tls_client(certs).wrap_socket(socket.create_connection(("127.0.0.1", ports[1])))
                raw_same = socket.create_connection(("127.0.0.1", ports[2]))
                same_memory = [bytearray(b.data) for b in blocks]  # distinct copies, as the node holds its blocks
                datas = [b.data for b in blocks]
                _tcp_push(raw, datas[:2])  # warm up every path
                _tcp_push(raw_tls, datas[:2])
                _tcp_push(raw_same, same_memory)
                await _store_round(client, blocks[:2], 0)
                put_s, fetch_s, stream_s, grpc_stream_s, tcp_s, tls_s, same_s = [], [], [], [], [], [], []
                store_cpu, raw_cpu, same_cpu = (
                    CpuMeter(node.pid),
                    CpuMeter(sink_pids[0] or 0),
                    CpuMeter(sink_pids[2] or 0),
                )
                for round_id in range(1, repeats + 1):
                    put, fetch, streamed, grpc_streamed = await _store_round(client, blocks, round_id, store_cpu)
                    put_s.append(put)
                    fetch_s.append(fetch)
                    stream_s.append(streamed)
                    grpc_stream_s.append(grpc_streamed)
                    tcp_s.append(_tcp_push(raw, datas, raw_cpu))
                    tls_s.append(_tcp_push(raw_tls, datas))
                    same_s.append(_tcp_push(raw_same, same_memory, same_cpu))
                raw.close()
                raw_tls.close()
                raw_same.close()
        finally:
            node.terminate()
            node.wait(10)
            for sink in sinks:
                sink.terminate()
            shutil.rmtree(certs.directory, ignore_errors=True)
    hmac_gbps, blake2b_gbps = _mac_gbps(payload * max(1, 64 * 2**20 // len(payload)), repeats)
    store_gbps = total / min(stream_s) / 1e9
    raw_gbps = total / min(tcp_s) / 1e9
    same_gbps = total / min(same_s) / 1e9

    def per_unit(seconds: list[float]) -> float:
        return round(statistics.median(seconds) * CPU_UNIT_BYTES / total, 4)

    cpu = {
        "store_reader": per_unit(store_cpu.own_s),
        "store_node": per_unit(store_cpu.peer_s),
        "raw_sender": per_unit(raw_cpu.own_s),
        "raw_reader": per_unit(raw_cpu.peer_s),
        "raw_same_memory_sender": per_unit(same_cpu.own_s),
        "raw_same_memory_reader": per_unit(same_cpu.peer_s),
    }
    return {
        "protection": protection,
        "store_gbps": round(store_gbps, 3),
        "raw_tcp_gbps": round(raw_gbps, 3),
        "ratio": round(store_gbps / raw_gbps, 3),
        "raw_tcp_same_memory_gbps": round(same_gbps, 3),
        "ratio_same_memory": round(store_gbps / same_gbps, 3),
        "raw_tls_gbps": round(total / min(tls_s) / 1e9, 3),
        "hmac_sha256_gbps": round(hmac_gbps, 3),
        "blake2b_keyed_gbps": round(blake2b_gbps, 3),
        "store_grpc_stream_gbps": round(total / min(grpc_stream_s) / 1e9, 3),
        "store_fetch_gbps": round(total / min(fetch_s) / 1e9, 3),
        "store_put_gbps": round(total / min(put_s) / 1e9, 3),
        "cpu_s_per_256mib": cpu,
        "megabytes": round(total / 2**20, 1),
        "block_bytes": num_block_bytes,
        "repeats": repeats,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


PROTECTIONS = ("tls", "mac", "none")


def run_transfer_bench(
    megabytes: int = 256, block_kib: int = 2048, repeats: int = 3, protection: str = "tls"
) -> dict[str, Any]:
    assert protection in PROTECTIONS, protection
    return asyncio.run(_run(megabytes, block_kib, repeats, protection))
