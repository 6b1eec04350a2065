"""In-process prefill and decode workers over loopback gRPC and a real NATS, and a test double of the KV store."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable

import grpc.aio

from engine_core import EngineConfig, LLMEngine, SamplingParams
from mesh.config import ServiceSettings
from mesh.pb import common_pb2, kvcache_pb2, kvcache_pb2_grpc
from mesh.service import ServiceRuntime


class DictKVCache(kvcache_pb2_grpc.KVCacheServicer):
    """kvcache.proto over a dict: a double of the contract only (the real store has its own tests)."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, kvcache_pb2.Block] = {}
        self.num_puts: Counter[bytes] = Counter()  # how often each key was put

    async def Put(
        self, request_iterator: AsyncIterator[kvcache_pb2.Block], context: grpc.aio.ServicerContext
    ) -> kvcache_pb2.PutResponse:
        num_stored = num_present = 0
        async for block in request_iterator:
            self.num_puts[block.block_hash] += 1
            if block.block_hash in self.blocks:
                num_present += 1
            else:
                self.blocks[block.block_hash] = block
                num_stored += 1
        return kvcache_pb2.PutResponse(num_stored=num_stored, num_present=num_present)

    def _prefix(self, block_hashes: list[bytes], model: str) -> list[kvcache_pb2.Block]:
        found = []
        for key in block_hashes:
            block = self.blocks.get(key)
            if block is None or block.layout.model != model:
                break
            found.append(block)
        return found

    def _held(self, key: bytes, model: str) -> kvcache_pb2.Block | None:
        block = self.blocks.get(key)
        return block if block is not None and block.layout.model == model else None

    async def Get(
        self, request: kvcache_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvcache_pb2.Block]:
        if request.skip_missing:
            for key in request.block_hashes:
                block = self._held(key, request.model)
                if block is not None:
                    yield block
            return
        for block in self._prefix(list(request.block_hashes), request.model):
            yield block

    async def Lookup(
        self, request: kvcache_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvcache_pb2.LookupResponse:
        indices = [-1 if self._held(key, request.model) is None else 0 for key in request.block_hashes]
        return kvcache_pb2.LookupResponse(
            num_hits=len(self._prefix(list(request.block_hashes), request.model)),
            fragment_indices=indices if request.per_block else [],
        )


async def start_store_node(nats_url: str, worker_id: str) -> tuple[ServiceRuntime, DictKVCache]:
    """A store node as the mesh sees one: a KVCache server announced on NATS with ROLE_KVCACHE heartbeats."""
    runtime = ServiceRuntime(
        ServiceSettings(nats_url=nats_url, heartbeat_interval_s=0.2, worker_id=worker_id, log_level="warning"),
        common_pb2.ROLE_KVCACHE,
    )
    store = DictKVCache()
    await runtime.start(
        register=lambda server: kvcache_pb2_grpc.add_KVCacheServicer_to_server(store, server),
        load=common_pb2.WorkerLoad,
    )
    return runtime, store


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def scrape(http_port: int, metric: str) -> dict[str, float]:
    """Samples of one metric from a /metrics endpoint, by label string."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(rf"^{metric}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            samples[match.group(1) or ""] = float(match.group(2))
    return samples


def reference_outputs(model_dir: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], list]:
    """(tokens, logprobs) of one in-process engine running the whole request."""
    engine = LLMEngine(EngineConfig(model_dir, device="cpu", num_kv_blocks=64, served_name=model_dir))
    engine.add_request("reference", prompt, params)
    tokens: list[int] = []
    logprobs: list = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
            logprobs += output.new_logprobs
    return tokens, logprobs
