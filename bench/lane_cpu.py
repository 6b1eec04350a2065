"""CPU seconds per 256 MiB that each end of a store read spends on the bulk lane: the reader (this process, every
thread) and the node (its process, every thread), read after read, with nothing else running in either process.
Prints one JSON object on stdout.

    .venv/bin/python bench/lane_cpu.py [--protection tls|mac|none] [--reads 9]

The setup is `kvmesh bench kv-transfer`'s (a kvcache node in its own process, embedded NATS, this process as a
prefill worker; 256 MiB of 2 MiB blocks put once), then one warm-up read and --reads layer-major reads of the
same blocks (the prefill read path, LayerStream over the lane, every block checked). The bench's own
`cpu_s_per_256mib` measures its read between a put and a fetch of 256 MiB, whose KV events this process is still
handling; here each read is alone, so the figure is the lane's. CPU time is what to compare where other jobs share
the cores: GB/s halves under load, CPU seconds per byte move far less.
  reader_s, node_s          per read (the median, and every read)
  reader_loop_s, node_loop_s  of which the event loop's thread (the rest: the lane's worker threads)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from kvmesh.bench.kv_transfer import MODEL, bench_layout, cpu_s_of, store_client  # noqa: E402
from kvmesh.certs import ProcessCertificates  # noqa: E402
from kvmesh.nats_server import EmbeddedNats, free_port  # noqa: E402
from services.prefill.prefiller import StoreBlock  # noqa: E402


def loop_cpu_s(pid: int) -> float:
    """CPU seconds of the process's first thread (its event loop's)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


async def measure(protection: str, num_reads: int) -> dict[str, object]:
    layout = bench_layout(2048)
    block_bytes = layout.num_block_bytes
    payload = os.urandom(block_bytes)
    blocks = [StoreBlock(n.to_bytes(32, "big"), b"\0" * 32, layout, payload) for n in range(2**28 // block_bytes)]
    keys = [b.block_hash for b in blocks]
    insecure = {"KVMESH_INSECURE": "1" if protection == "none" else "0"}
    certs = ProcessCertificates(Path(tempfile.mkdtemp(prefix="kvmesh-lane-cpu-")), insecure)
    rows: list[dict[str, float]] = []
    with EmbeddedNats() as nats:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)]),  # the node runs this tree's code
            "KVMESH_NATS_URL": nats.url,
            "KVMESH_WORKER_ID": "lane-cpu",
            "KVMESH_LOG_LEVEL": "warning",
            "KVMESH_CAPACITY_BYTES": str(2**30),
            "KVMESH_HEARTBEAT_INTERVAL_S": "0.2",
            "KVMESH_HTTP_PORT": str(free_port()),
            "KVMESH_LANE_ENCRYPT": "0" if protection == "mac" else "1",
            **insecure,
            **certs.env("kvcache", "lane-cpu"),
        }
        node = subprocess.Popen([sys.executable, "-m", "services.kvcache"], env=env)
        try:
            async with store_client(nats.url, "lane-cpu", certs, node) as client:
                await client.put(blocks)
                while client.index.num_leading_hits("lane-cpu", keys) < len(keys):
                    await asyncio.sleep(0.01)
                await asyncio.sleep(1.0)  # the put's events handled
                for n in range(num_reads + 1):
                    stream = client.plan_stream(MODEL, keys)
                    assert stream is not None
                    own, node_s = time.process_time(), cpu_s_of(node.pid)
                    own_loop, node_loop = loop_cpu_s(os.getpid()), loop_cpu_s(node.pid)
                    assert await stream.run(layout, len(keys), lambda layer, pieces: None)
                    if n:  # the first read fills the reader's buffer pool
                        rows.append(
                            {
                                "reader_s": time.process_time() - own,
                                "node_s": cpu_s_of(node.pid) - node_s,
                                "reader_loop_s": loop_cpu_s(os.getpid()) - own_loop,
                                "node_loop_s": loop_cpu_s(node.pid) - node_loop,
                            }
                        )
        finally:
            node.terminate()
            node.wait(10)
            shutil.rmtree(certs.directory, ignore_errors=True)
    result: dict[str, object] = {"protection": protection, "reads": num_reads}
    for key in rows[0]:
        result[key] = round(statistics.median(row[key] for row in rows), 4)
    result["reader_s_each"] = [round(row["reader_s"], 4) for row in rows]
    result["node_s_each"] = [round(row["node_s"], 4) for row in rows]
    result["load_average_1m"] = round(os.getloadavg()[0], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protection", choices=("tls", "mac", "none"), default="tls")
    parser.add_argument("--reads", type=int, default=9)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.protection, args.reads))))


if __name__ == "__main__":
    main()
