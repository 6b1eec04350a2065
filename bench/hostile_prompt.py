"""A body just under the gateway's 8 MiB cap, all prompt text: how fast the gateway refuses it, whether /healthz
waits meanwhile, and whether the gateway's memory comes back. Prints one JSON object on stdout.

    .venv/bin/python bench/hostile_prompt.py [--model deepseek-tiny] [--repeats 10] [--body-bytes N]

`--body-bytes 1048576`: 1 MiB of words, which bytes / longest piece cannot prove too long (8,192 tokens for
DeepSeek-V3's vocabulary) and the bound by byte counts can (engine_core.token_bound).

The gateway runs in this process as the tests start it (a real NATS, real HTTP on loopback, the model's real
tokenizer; no workers: the prompt is refused before routing). Figures:
  refuse_ms            the huge body's round trip to its 400 (median and max of --repeats, sequential)
  baseline_401_ms      the same body with a wrong key (refused at authentication, never parsed): the cost of
                       moving 8 MiB over loopback, measured in the same run; ratio = refuse / baseline
  healthz_idle_ms      /healthz round trip with nothing else running (median of 50)
  healthz_busy_ms      /healthz round trip while two huge bodies at a time are being refused (median and max)
  rss_growth_mb        this process's resident memory after `--repeats` huge refusals minus before them
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

import aiohttp  # noqa: E402

from engine_core import model_store  # noqa: E402
from kvmesh.certs import init_directory  # noqa: E402
from kvmesh.nats_server import EmbeddedNats  # noqa: E402
from services.gateway.catalog import ModelCatalog, load_model  # noqa: E402
from services.gateway.config import GatewaySettings  # noqa: E402
from services.gateway.server import GatewayServer  # noqa: E402

KEY = "sk-bench-hostile"
BODY_BYTES = 8 * 2**20 - 1024


def huge_body(model: str, num_bytes: int) -> bytes:
    message = {"role": "user", "content": ""}
    body = {"model": model, "messages": [message], "max_tokens": 16}
    room = num_bytes - len(json.dumps(body).encode())
    message["content"] = "word " * (room // 5) + "x" * (room % 5)
    return json.dumps(body).encode()


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


async def timed_post(session: aiohttp.ClientSession, url: str, data: bytes, key: str) -> tuple[float, int]:
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with session.post(url, data=data, headers=headers) as response:
        await response.read()
        return (time.perf_counter() - start) * 1000, response.status


async def healthz_ms(session: aiohttp.ClientSession, base: str) -> float:
    start = time.perf_counter()
    async with session.get(f"{base}/healthz") as response:
        await response.read()
        assert response.status == 200
    return (time.perf_counter() - start) * 1000


async def measure(model: str, repeats: int, body_bytes: int) -> dict[str, Any]:
    certificates = tempfile.TemporaryDirectory()
    if not any(os.environ.get(f"KVMESH_{name}") for name in ("TLS_DIR", "TLS_CERT", "INSECURE")):
        init_directory(Path(certificates.name))  # a throwaway CA, as `kvmesh up` makes: the gateway's gRPC is mTLS
        os.environ["KVMESH_TLS_DIR"] = certificates.name
    catalog = ModelCatalog([load_model(str(model_store.ensure(model)))])
    with EmbeddedNats() as nats, tempfile.TemporaryDirectory() as state_dir:
        settings = GatewaySettings(
            nats_url=nats.url,
            http_port=0,
            grpc_port=0,
            api_keys=(KEY,),
            state_dir=state_dir,
            models=(model,),
            log_level="error",
        )
        gateway = GatewayServer(settings, catalog=catalog)
        await gateway.start()
        base = f"http://127.0.0.1:{gateway.http_port}"
        url = f"{base}/v1/chat/completions"
        data = huge_body(catalog.names[0], body_bytes)
        try:
            async with aiohttp.ClientSession() as session:
                _, status = await timed_post(session, url, data, KEY)  # warm: the first request builds caches
                assert status == 400, status
                baseline = [(await timed_post(session, url, data, "sk-wrong"))[0] for _ in range(repeats)]
                idle = [await healthz_ms(session, base) for _ in range(50)]
                gc.collect()
                rss_before = rss_mb()
                refused = []
                for _ in range(repeats):
                    elapsed, status = await timed_post(session, url, data, KEY)
                    assert status == 400, status
                    refused.append(elapsed)
                gc.collect()
                rss_after = rss_mb()
                busy: list[float] = []

                async def probe() -> None:
                    for _ in range(50):
                        busy.append(await healthz_ms(session, base))
                        await asyncio.sleep(0.005)

                async def flood() -> None:
                    for _ in range(repeats // 2 or 1):
                        await asyncio.gather(*(timed_post(session, url, data, KEY) for _ in range(2)))

                await asyncio.gather(probe(), flood())
        finally:
            await gateway.stop()
            certificates.cleanup()
    return {
        "model": model,
        "body_bytes": len(data),
        "repeats": repeats,
        "refuse_ms": {"median": round(statistics.median(refused), 1), "max": round(max(refused), 1)},
        "baseline_401_ms": {"median": round(statistics.median(baseline), 1), "max": round(max(baseline), 1)},
        "ratio": round(statistics.median(refused) / statistics.median(baseline), 2),
        "healthz_idle_ms": {"median": round(statistics.median(idle), 2), "max": round(max(idle), 2)},
        "healthz_busy_ms": {"median": round(statistics.median(busy), 2), "max": round(max(busy), 2)},
        "rss_before_mb": round(rss_before, 1),
        "rss_after_mb": round(rss_after, 1),
        "rss_growth_mb": round(rss_after - rss_before, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-tiny")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--body-bytes", type=int, default=BODY_BYTES)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.model, args.repeats, args.body_bytes))))


if __name__ == "__main__":
    main()
