"""In-process prefill and decode workers over loopback gRPC and a real NATS (the `mesh` fixture: each test
file that takes it starts its own), what the tests read from them, and a test double of the KV store.

The workers run in this process (their `start()`/`stop()` are what `serve()` runs), on one module-wide loop."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from engine_core import EngineConfig, LLMEngine, SamplingParams
from kvmesh.nats_server import EmbeddedNats
from mesh import rpc, subjects, tls
from mesh.access import GATEWAY, PREFILL
from mesh.bus import Bus
from mesh.compute.convert import sampling_to_proto
from mesh.config import ServiceSettings, load_settings
from mesh.pb import (
    common_pb2,
    decode_pb2_grpc,
    events_pb2,
    kvcache_pb2,
    kvcache_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from mesh.service import ServiceRuntime
from services.decode.config import DecodeSettings
from services.decode.server import DecodeService
from services.prefill.config import PrefillSettings
from services.prefill.server import PrefillService


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


HEARTBEAT_S = 0.2


LLAMA_BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block * kv heads * head size * fp32


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


LONG = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)  # seconds of decoding


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 490, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Mesh:
    prefill: PrefillService
    decode: DecodeService
    small_decode: DecodeService  # llama only, 8 blocks: easy to fill
    stores: dict[str, DictKVCache]  # worker id -> its blocks
    prefill_stub: prefill_pb2_grpc.PrefillStub
    decode_stub: decode_pb2_grpc.DecodeStub
    small_decode_stub: decode_pb2_grpc.DecodeStub  # calls as prefill: it pushes KV
    decode_push_stub: decode_pb2_grpc.DecodeStub  # to `decode`, as prefill (decode_stub calls as the gateway)
    channels: rpc.Channels
    llama: str
    deepseek: str
    nats_url: str

    def request(
        self,
        request_id: str,
        model: str,
        prompt: list[int],
        params: SamplingParams,
        decode: DecodeService | None = None,
        **fields: object,
    ) -> prefill_pb2.PrefillRequest:
        decode = decode or self.decode
        values: dict = dict(
            request_id=request_id,
            model=model,
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(params),
            decode_address=decode.runtime.address,
            decode_worker_id=decode.runtime.worker_id,
            decode_data_address=decode.runtime.data_address,
        )  # pushes go over the bulk lane
        return prefill_pb2.PrefillRequest(**{**values, **fields})


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as nats:
        yield nats.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(nats_url, llama_reference, deepseek_reference) -> AsyncIterator[Mesh]:
    llama, deepseek = str(llama_reference[0]), str(deepseek_reference[0])
    common = dict(
        nats_url=nats_url,
        heartbeat_interval_s=HEARTBEAT_S,
        log_level="warning",
        drain_timeout_s=5.0,
        models=(llama, deepseek),
        kv_cache_memory_bytes=2 * 2**20,
    )
    store_nodes = [await start_store_node(nats_url, f"kvcache-{i}") for i in range(2)]
    decode = await DecodeService.start(load_settings(DecodeSettings, env={}, worker_id="decode-t", **common))
    small_decode = await DecodeService.start(
        load_settings(
            DecodeSettings,
            env={},
            **{**common, "models": (llama,), "kv_cache_memory_bytes": 8 * LLAMA_BLOCK_BYTES},
            worker_id="decode-small",
        )
    )
    # the store double publishes no KV events, so prefill probes it (Lookup) instead of reading the global index
    prefill = await PrefillService.start(
        # always: these tests are about the store path; test_pd_kv_store.py sets the planner where it is the subject
        load_settings(
            PrefillSettings, env={}, worker_id="prefill-t", kv_index_enabled=False, kv_fetch="always", **common
        )
    )
    assert prefill.registry is not None
    await wait_until(lambda: len(prefill.registry.workers()) == 2, what="prefill to hear both store nodes")
    assert prefill.writer is not None
    await wait_until(lambda: prefill.writer.is_accepting, what="prefill to start writing to the store")
    channels = rpc.Channels(tls.load_credentials(GATEWAY))  # the gateway starts requests, attaches and aborts
    as_prefill = rpc.Channels(tls.load_credentials(PREFILL))  # only prefill may push KV to decode
    yield Mesh(
        prefill,
        decode,
        small_decode,
        {r.worker_id: s for r, s in store_nodes},
        prefill_pb2_grpc.PrefillStub(channels.get(prefill.runtime.address)),
        decode_pb2_grpc.DecodeStub(channels.get(decode.runtime.address)),
        decode_pb2_grpc.DecodeStub(as_prefill.get(small_decode.runtime.address)),
        decode_pb2_grpc.DecodeStub(as_prefill.get(decode.runtime.address)),
        channels,
        llama,
        deepseek,
        nats_url,
    )
    await channels.close()
    await as_prefill.close()
    for service in (prefill, decode, small_decode):
        await service.stop()
    for runtime, _ in store_nodes:
        await runtime.shutdown()


async def engine_stats(service: PrefillService | DecodeService, model: str):
    assert service.engines is not None
    return await service.engines.get(model).call(lambda e: e.stats())


async def wait_for_free_blocks(service: PrefillService | DecodeService, model: str) -> None:
    """Every block of the model's engine free again (cached blocks count as free) and nothing running."""
    for _ in range(200):
        stats = await engine_stats(service, model)
        if stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks still held: {stats}")


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def trailing(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {key: value for key, value in error.trailing_metadata() or ()}


async def next_heartbeat(
    nats_url: str, role: str, worker_id: str, condition: Callable[[events_pb2.WorkerHeartbeat], bool]
) -> events_pb2.WorkerHeartbeat:
    """The first heartbeat of the worker that meets the condition."""
    found: asyncio.Future[events_pb2.WorkerHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_beat(beat: events_pb2.WorkerHeartbeat, subject: str) -> None:
        if beat.worker.worker_id == worker_id and condition(beat) and not found.done():
            found.set_result(beat)

    bus = await Bus.connect(nats_url, "test-heartbeats")
    try:
        await bus.subscribe(subjects.heartbeat(role), events_pb2.WorkerHeartbeat, on_beat)
        return await asyncio.wait_for(found, 5.0)
    finally:
        await bus.close()
