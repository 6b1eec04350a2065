"""A real mesh in this process for the API tests: NATS, a balancer, one prefill and one decode worker running
the real engines (SmolLM2 with real weights, deepseek-tiny, deepseek-v4-tiny), and the gateway. Clients: the
official `openai` and `anthropic` SDKs, raw HTTP, and the Gateway gRPC API."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import anthropic
import openai

from kvmesh.nats_server import EmbeddedNats, free_port
from mesh.config import load_settings
from services.balancer.config import BalancerSettings
from services.balancer.server import serve as serve_balancer
from services.decode.config import DecodeSettings
from services.decode.server import DecodeService
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer
from services.prefill.config import PrefillSettings
from services.prefill.server import PrefillService

from .harness import serving

KEY = "sk-api-test-4c1d"
ADMIN_KEY = "sk-api-admin-9b7e"  # /admin/v1/ (tenants and keys of the tenancy tests)
SMOL = "smollm2-135m"
DEEPSEEK = "deepseek-tiny"
DEEPSEEK_V4 = "deepseek-v4-tiny"
MODELS = (SMOL, DEEPSEEK, DEEPSEEK_V4)


@dataclass
class ApiMesh:
    gateway: GatewayServer
    prefill: PrefillService
    decode: DecodeService
    base_url: str
    grpc_address: str
    nats_url: str

    def openai(self, key: str = KEY, max_retries: int = 0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=max_retries, timeout=120)

    def anthropic(self, key: str = KEY) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.base_url, api_key=key, max_retries=0, timeout=120)


@contextlib.asynccontextmanager
async def api_mesh(models: tuple[str, ...] = MODELS) -> AsyncIterator[ApiMesh]:
    with EmbeddedNats() as nats, tempfile.TemporaryDirectory() as state_dir:
        common = dict(nats_url=nats.url, heartbeat_interval_s=1.0, log_level="warning", drain_timeout_s=1.0)
        workers = dict(common, models=models, kv_cache_memory_bytes=16 * 2**20)
        balancer = load_settings(BalancerSettings, env={}, grpc_port=free_port(), worker_id="balancer-t", **common)
        async with serving(serve_balancer, balancer):
            decode = await DecodeService.start(load_settings(DecodeSettings, env={}, worker_id="decode-t", **workers))
            prefill = await PrefillService.start(
                load_settings(PrefillSettings, env={}, worker_id="prefill-t", kvcache_enabled=False, **workers)
            )
            gateway = GatewayServer(
                GatewaySettings(
                    nats_url=nats.url,
                    http_port=0,
                    grpc_port=0,
                    api_keys=(KEY,),
                    admin_key=ADMIN_KEY,
                    state_dir=state_dir,  # the tenancy database and server secret
                    models=models,
                    heartbeat_interval_s=1.0,
                    log_level="warning",
                )
            )
            await gateway.start()
            base_url = f"http://127.0.0.1:{gateway.http_port}"
            async with aiohttp.ClientSession() as session:
                for _ in range(200):
                    async with session.get(f"{base_url}/readyz") as response:
                        if response.status == 200 and len(gateway.core.served_models()) == len(models):  # type: ignore[union-attr]
                            break
                    await asyncio.sleep(0.05)
            mesh = ApiMesh(gateway, prefill, decode, base_url, f"127.0.0.1:{gateway.grpc_port}", nats.url)
            try:
                await _wait_until_routed(mesh, models)
                yield mesh
            finally:
                await gateway.stop()
                await prefill.stop()
                await decode.stop()


async def _wait_until_routed(mesh: ApiMesh, models: tuple[str, ...]) -> None:
    """The balancer hears workers on its own heartbeats: wait until a request for each model gets through."""
    client = mesh.openai()
    for model in models:
        for _ in range(100):
            try:
                await client.completions.create(model=model, prompt="hi", max_tokens=1)
                break
            except openai.InternalServerError:
                await asyncio.sleep(0.1)
