"""`kvmesh bench serve`: the mesh under load, through its REST API, against the same engine run in-process.

Starts its own mesh (one prefill, one decode, one KV store; `kvmesh up`'s launcher) unless --url is given (with
--api-key, or KVMESH_API_KEY, for that deployment's key), then sends `requests` streamed chat completions with
`concurrency` in flight. Per request it records the time to the first token, the gaps between tokens, and the
prefill engine's own time (the gateway's `server-timing: prefill;dur=...` header), so that TTFT - prefill time is
what the mesh adds: HTTP, tokenizing, routing, gRPC, and pushing the KV to decode. The in-process baseline runs
the same prompts through one `LLMEngine` with the same batch limit, so the throughput ratio prices disaggregation
on this machine.

--trace turns OpenTelemetry tracing on in every process of the mesh it starts, exporting over OTLP/gRPC to a
receiver in this process (otlp_sink.py), and reports the spans received per request: run it with and without to
price tracing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvmesh.bench.otlp_sink import OTLPSink

WORDS = [
    "river",
    "stone",
    "cloud",
    "garden",
    "lantern",
    "harbor",
    "meadow",
    "signal",
    "copper",
    "violet",
    "orbit",
    "canyon",
    "ember",
    "willow",
    "compass",
    "thunder",
    "marble",
    "falcon",
    "prism",
    "tide",
    "glacier",
    "ribbon",
]
API_KEY = "sk-kvmesh-bench"  # the key of the mesh the bench starts itself


class KeyRefusedError(ValueError):
    """The gateway refused the API key (HTTP 401): the command line says which key to pass."""


@dataclass
class Sample:
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    num_tokens: int = 0


def make_prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Request {i}. Continue this list: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)
    ]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(
    session: aiohttp.ClientSession, url: str, api_key: str, model: str, prompt: str, max_tokens: int
) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sample = Sample()
    start = time.perf_counter()
    last = start
    async with session.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
    ) as response:
        if response.status == 401:
            raise KeyRefusedError(
                f"the gateway at {url} refused the API key: pass its key with --api-key or KVMESH_API_KEY"
            )
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        timing = response.headers.get("server-timing", "prefill;dur=0")
        sample.prefill_s = float(timing.split("dur=")[1]) / 1000
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the gateway ends a failed stream with an error frame, not a chunk
                raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
            if chunk.get("usage"):
                sample.num_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if sample.ttft_s == 0.0:
                sample.ttft_s = now - start
            else:
                sample.gaps_s.append(now - last)
            last = now
    sample.e2e_s = time.perf_counter() - start
    return sample


async def _load(
    url: str, api_key: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[Sample], float]:
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def bounded(prompt: str) -> Sample:
            async with semaphore:
                return await one_request(session, url, api_key, model, prompt, max_tokens)

        await asyncio.gather(*(bounded(p) for p in prompts[:2]))  # warm-up: first calls load lazy paths
        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(p) for p in prompts[2:]))
        return list(samples), time.perf_counter() - start


def _in_process(model: str, prompts: list[str], concurrency: int, max_tokens: int) -> float:
    """Output tokens/s of the same prompts through one engine in this process (same batch limit)."""
    import torch

    from engine_core import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model, device="cpu", max_num_seqs=concurrency, kv_cache_memory_bytes=256 * 2**20))
    assert engine.tokenizer is not None
    ids = [
        engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
        )
        for p in prompts
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("warm", ids[0], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    for i, prompt_ids in enumerate(ids[2:]):
        engine.add_request(f"r{i}", prompt_ids, params)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - start)


def start_mesh(stack: contextlib.ExitStack, model: str, max_num_seqs: int, api_key: str, env: dict[str, str]) -> str:
    """A mesh of one prefill, one decode and one KV store (`kvmesh up`'s launcher), stopped when `stack` closes;
    its gateway's URL."""
    from kvmesh.nats_server import free_port
    from kvmesh.up import Mesh, MeshPlan

    plan = MeshPlan(
        prefill=1,
        decode=1,
        kvcache=1,
        encoder=0,
        models=(model,),
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=(api_key,),
        env={"KVMESH_LOG_LEVEL": "warning", "KVMESH_MAX_NUM_SEQS": str(max_num_seqs), **env},
    )
    devnull = stack.enter_context(open(os.devnull, "w"))  # noqa: SIM115 - the caller's stack closes it
    mesh = Mesh(plan, out=devnull)
    stack.callback(mesh.stop)
    mesh.start()
    mesh.wait_ready()
    return mesh.base_url


def run_serve_bench(
    concurrency: int,
    num_requests: int,
    model: str,
    prompt_words: int,
    max_tokens: int,
    url: str | None = None,
    seed: int = 0,
    api_key: str | None = None,
    trace: bool = False,
    baseline: bool = True,
) -> dict[str, Any]:
    """`api_key`: the gateway's key (default: the built-in key of the mesh started here). `trace`: the mesh started
    here exports its spans to an OTLP receiver in this process. `baseline`: also run the in-process engine."""
    if trace and url is not None:
        raise ValueError("--trace applies to the mesh the bench starts: leave out --url")
    api_key = api_key or API_KEY
    prompts = make_prompts(num_requests + 2, prompt_words, seed)
    sink = None
    with contextlib.ExitStack() as stack:
        if url is None:
            if trace:
                sink = stack.enter_context(OTLPSink())
            url = start_mesh(stack, model, concurrency, api_key, sink.exporter_env() if sink is not None else {})
        samples, seconds = asyncio.run(_load(url, api_key, model, prompts, concurrency, max_tokens))
        if sink is not None:
            time.sleep(1.0)  # the batch processors' last exports (OTEL_BSP_SCHEDULE_DELAY is theirs to set)
            num_spans = len(sink.spans())
    in_process = _in_process(model, prompts, concurrency, max_tokens) if baseline else 0.0
    ttft = [s.ttft_s for s in samples]
    overhead = [s.ttft_s - s.prefill_s for s in samples]
    gaps = [g for s in samples for g in s.gaps_s]
    throughput = sum(s.num_tokens for s in samples) / seconds
    return {
        "model": model,
        "concurrency": concurrency,
        "requests": len(samples),
        "prompt_words": prompt_words,
        "max_tokens": max_tokens,
        "throughput_tok_s": round(throughput, 2),
        "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 1),
        "itl_p50_ms": round(percentile(gaps, 50) * 1000, 2),
        "itl_p99_ms": round(percentile(gaps, 99) * 1000, 2),
        "e2e_p50_s": round(statistics.median(s.e2e_s for s in samples), 3),
        "prefill_engine_p50_ms": round(percentile([s.prefill_s for s in samples], 50) * 1000, 1),
        "mesh_overhead_p50_ms": round(percentile(overhead, 50) * 1000, 2),
        "mesh_overhead_p99_ms": round(percentile(overhead, 99) * 1000, 2),
        "in_process_throughput_tok_s": round(in_process, 2),
        "throughput_vs_in_process": round(throughput / in_process, 3) if baseline else None,
        "goal_overhead_p50_under_10ms": percentile(overhead, 50) < 0.010,
        "tracing": trace,
        **({"spans_per_request": round(num_spans / len(prompts), 1)} if sink is not None else {}),
    }
