"""`kvmesh bench kv-ttft`: time to first token on a long shared prefix, cold and then through the KV store.

Starts a mesh (two prefill workers, one decode, one KV store node; `kvmesh up`'s launcher) and sends one long
prompt (~`prompt_tokens` tokens) three times, streaming, with the time to the first token measured by the client:
  1. cold: nothing cached anywhere; the prefill worker computes it all and writes its blocks to the store;
  2. store: the worker that computed it is stopped (its device cache goes with it), so the other worker serves
     the same prompt from the KV store: fetch, check, inject, compute only the last partial block;
  3. device: the same prompt again, now in that worker's own device cache (for reference).
`speedup` is cold / store (goal: at least 3).
"""

from __future__ import annotations

import json
import signal
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvmesh.bench.engine import PROMPT_TEXT
from kvmesh.nats_server import free_port
from kvmesh.up import Mesh, MeshPlan

API_KEY = "sk-kvmesh-bench"


def long_prompt(num_tokens: int) -> str:
    words = PROMPT_TEXT.split()
    count = int(num_tokens * 0.84)  # about 1.2 tokens per word for this text (smollm2)
    return "Summarize this story in one sentence. " + " ".join(words[i % len(words)] for i in range(count))


def stream_chat(url: str, model: str, prompt: str) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    started = time.perf_counter()
    ttft = 0.0
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=600) as response:
        worker = response.headers.get("x-kvmesh-prefill-worker", "")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and not ttft:
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "ttft_s": round(ttft, 3),
        "prefill_worker": worker,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": cached,
    }


def scrape_total(port: int, metric: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(metric))


def run_ttft_bench(model: str = "smollm2-135m", prompt_tokens: int = 2000) -> dict[str, Any]:
    log = Path(tempfile.mkdtemp(prefix="kvmesh-ttft-")) / "mesh.log"
    plan = MeshPlan(
        prefill=2,
        decode=1,
        kvcache=1,
        models=(model,),
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=(API_KEY,),
        env={
            "KVMESH_HEARTBEAT_INTERVAL_S": "0.5",
            "KVMESH_LOG_LEVEL": "warning",
            "KVMESH_KV_CACHE_MEMORY_BYTES": str(512 * 2**20),
        },
    )
    mesh = Mesh(plan, out=log.open("w"))
    try:
        mesh.start()
        mesh.wait_ready(timeout_s=300)
        time.sleep(2.0)  # every worker in the balancer's pools
        prompt = long_prompt(prompt_tokens)
        stream_chat(mesh.base_url, model, "Say hello.")  # warm up the path (first request of each process)
        cold = stream_chat(mesh.base_url, model, prompt)
        store_port = mesh.child("kvcache-0").http_port
        expected_blocks = (cold["prompt_tokens"] - 1) // 16
        deadline = time.monotonic() + 60
        while scrape_total(store_port, 'kvmesh_kvcache_blocks{tier="host"}') < expected_blocks:
            if time.monotonic() > deadline:
                raise TimeoutError("the prompt's blocks did not reach the store")
            time.sleep(0.1)
        mesh.kill(cold["prefill_worker"], signal.SIGTERM)
        time.sleep(1.0)
        from_store = stream_chat(mesh.base_url, model, prompt)
        from_device = stream_chat(mesh.base_url, model, prompt)
    finally:
        mesh.stop()
    return {
        "model": model,
        "prompt_tokens": cold["prompt_tokens"],
        "ttft_cold_s": cold["ttft_s"],
        "ttft_store_s": from_store["ttft_s"],
        "ttft_device_s": from_device["ttft_s"],
        "store_cached_tokens": from_store["cached_tokens"],
        "speedup": round(cold["ttft_s"] / max(from_store["ttft_s"], 1e-9), 2),
        "workers": [cold["prefill_worker"], from_store["prefill_worker"], from_device["prefill_worker"]],
        "log": str(log),
    }
