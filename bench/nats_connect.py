"""What NATS users cost a connecting role: the time from `Bus.connect` to a flushed PING against a real
nats-server, without users (KVMESH_INSECURE=1: the baseline, same run), with the embedded server's users (bcrypt
work factor 4), with those and TLS with a client certificate (what `kvmesh up` runs), and with the users
`kvmesh certs init` writes (work factor 10). Prints one JSON object on stdout.

    .venv/bin/python bench/nats_connect.py [--repeats 20]

Figures (milliseconds, median and max of --repeats sequential connects each), and ratio = median / baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from kvmesh import nats_config  # noqa: E402
from kvmesh.certs import NATS_DIR, ProcessCertificates  # noqa: E402
from kvmesh.nats_server import EmbeddedNats  # noqa: E402
from mesh.bus import Bus  # noqa: E402
from mesh.tls import CA_FILE, client_ssl_context  # noqa: E402


async def connect_ms(url: str, repeats: int, tls: ssl.SSLContext | None = None) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        bus = await Bus.connect(url, "bench-nats-connect", tls=tls)
        await bus.flush()
        times.append((time.perf_counter() - started) * 1000)
        await bus.client.close()
    return times


def summary(times: list[float], baseline: float | None) -> dict[str, Any]:
    median = statistics.median(times)
    figures: dict[str, Any] = {"median_ms": round(median, 2), "max_ms": round(max(times), 2)}
    if baseline:
        figures["ratio"] = round(median / baseline, 2)
    return figures


async def measure(repeats: int) -> dict[str, Any]:
    with EmbeddedNats(insecure=True) as server:
        baseline = await connect_ms(server.url, repeats)
    with EmbeddedNats(insecure=False) as server:
        embedded = await connect_ms(server.url_as("decode"), repeats)
    with tempfile.TemporaryDirectory() as directory:  # a throwaway CA, as `kvmesh up` makes
        certificates = ProcessCertificates(Path(directory), {})
        server_dir = certificates.issue(NATS_DIR, NATS_DIR)
        files = (server_dir / f"{NATS_DIR}.pem", server_dir / f"{NATS_DIR}-key.pem", server_dir / CA_FILE)
        credentials = certificates.credentials("decode", "decode-0")
        assert credentials is not None
        with EmbeddedNats(insecure=False, tls=nats_config.ServerTLS(*files)) as server:
            embedded_tls = await connect_ms(server.url_as("decode"), repeats, client_ssl_context(credentials))
    with EmbeddedNats(insecure=False, bcrypt_rounds=nats_config.BCRYPT_ROUNDS) as server:  # the deployment's
        deployed = await connect_ms(server.url_as("decode"), repeats)
    base = statistics.median(baseline)
    return {
        "repeats": repeats,
        "no_users": summary(baseline, None),
        f"embedded_bcrypt_{nats_config.EMBEDDED_BCRYPT_ROUNDS}": summary(embedded, base),
        f"embedded_bcrypt_{nats_config.EMBEDDED_BCRYPT_ROUNDS}_tls": summary(embedded_tls, base),
        f"certs_init_bcrypt_{nats_config.BCRYPT_ROUNDS}": summary(deployed, base),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.repeats))))


if __name__ == "__main__":
    main()
