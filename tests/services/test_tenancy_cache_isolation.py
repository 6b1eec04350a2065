"""Tenants never share KV unless an admin says so, on a real gateway over a real NATS and SQLite, against the
fake workers of gateway_harness.py (which record the block keys the balancer and prefill are asked for): the
same prompt from two tenants has different block keys, from one tenant (or two of one cache_group) equal ones;
cache_salt still separates within a tenant; and the default tenant's keys are exactly those of a mesh without
tenants. The workers hash from the salt that prefill receives, so the route's keys are the workers' keys."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine_core import model_store
from engine_core.kv_cache.block_hash import hash_token_blocks, root_hash
from kvmesh.nats_server import EmbeddedNats
from mesh.bus import Bus
from services.gateway import telemetry
from services.gateway.catalog import ModelCatalog, ServedModel, load_model
from services.gateway.server import GatewayServer
from services.gateway.tenancy.metric_labels import TenantLabels

from .gateway_harness import COMPLETION, KEY, MODEL, Fakes, Script, gateway_settings, wait_for_ready

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN_KEY = "sk-admin-cache-isolation-5c1e"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "Tell me a long story about the sea, the wind and the lighthouse keeper who watched them both"


@dataclass
class Gateway:
    fakes: Fakes
    server: GatewayServer
    model: ServedModel
    session: aiohttp.ClientSession
    base_url: str

    async def call(self, method: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"}
        async with self.session.request(method, self.base_url + path, json=body, headers=headers) as response:
            return response.status, await response.json()

    async def tenant(self, name: str, cache_group: str | None = None) -> tuple[str, str]:
        """A new tenant (made through the admin API) and a key of it."""
        body: dict[str, Any] = {"name": name} | ({"cache_group": cache_group} if cache_group else {})
        status, tenant = await self.call("POST", "/admin/v1/tenants", ADMIN_KEY, body)
        assert status == 201, tenant
        status, key = await self.call("POST", "/admin/v1/keys", ADMIN_KEY, {"tenant": tenant["id"], "name": "k"})
        assert status == 201, key
        return tenant["id"], key["key"]

    async def block_keys(self, key: str, cache_salt: str | None = None) -> list[bytes]:
        """The block keys the balancer was asked to route PROMPT by (after checking prefill got the same)."""
        self.fakes.script = Script(token_ids=self.model.tokenizer.encode(COMPLETION, add_special_tokens=False))
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        status, answer = await self.call("POST", "/v1/chat/completions", key, body)
        assert status == 200, answer
        (route,), (prefill,) = self.fakes.script.routes, self.fakes.script.prefills
        block_size = self.server.settings.block_size
        workers_keys = hash_token_blocks(
            root_hash(MODEL, prefill.cache_salt or None), list(prefill.prompt_token_ids), block_size
        )
        assert list(route.block_hashes) == workers_keys
        assert len(workers_keys) == len(prefill.prompt_token_ids) // block_size >= 1
        return workers_keys


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway() -> AsyncIterator[Gateway]:
    loaded = load_model(str(model_store.ensure(MODEL)))
    model = ServedModel(MODEL, loaded.tokenizer, loaded.context_len)
    with EmbeddedNats() as nats, tempfile.TemporaryDirectory() as state_dir:
        fakes = Fakes()
        grpc_server = await fakes.serve()
        bus = await Bus.connect(nats.url, name="fake-workers")
        announcers = fakes.announcers(bus)
        settings = gateway_settings(nats.url, state_dir, admin_key=ADMIN_KEY)
        server = GatewayServer(settings, catalog=ModelCatalog([model]))
        await server.start()
        for announcer in announcers:
            await announcer.start()
        base_url = f"http://127.0.0.1:{server.http_port}"
        try:
            await wait_for_ready(base_url)
            async with aiohttp.ClientSession() as session:
                yield Gateway(fakes, server, model, session, base_url)
        finally:
            for announcer in announcers:
                await announcer.stop()
            await server.stop()
            await bus.close()
            await grpc_server.stop(grace=None)


async def test_the_default_tenant_keeps_todays_block_keys(gateway: Gateway) -> None:
    prompt_ids = gateway.model.render_chat([{"role": "user", "content": PROMPT}])
    block_size = gateway.server.settings.block_size
    assert await gateway.block_keys(KEY) == hash_token_blocks(root_hash(MODEL), prompt_ids, block_size)
    assert gateway.fakes.script.prefills[0].cache_salt == ""
    salted = hash_token_blocks(root_hash(MODEL, "mine"), prompt_ids, block_size)
    assert await gateway.block_keys(KEY, cache_salt="mine") == salted
    assert gateway.fakes.script.prefills[0].cache_salt == "mine"


async def test_two_tenants_never_share_block_keys(gateway: Gateway) -> None:
    _, acme = await gateway.tenant("acme")
    _, globex = await gateway.tenant("globex")
    acme_keys, globex_keys, default_keys = (
        await gateway.block_keys(acme),
        await gateway.block_keys(globex),
        await gateway.block_keys(KEY),
    )
    assert len({acme_keys[0], globex_keys[0], default_keys[0]}) == 3
    assert set(acme_keys).isdisjoint(globex_keys) and set(acme_keys).isdisjoint(default_keys)
    assert await gateway.block_keys(acme) == acme_keys  # one tenant: its own hits, every time
    salt = gateway.fakes.script.prefills[0].cache_salt
    assert salt.startswith("t1:") and len(salt) == 3 + 64  # an HMAC, never the tenant's id or name
    # the client's cache_salt still separates within a tenant, and never crosses into another's
    acme_salted = await gateway.block_keys(acme, cache_salt="s1")
    assert set(acme_salted).isdisjoint(acme_keys)
    assert await gateway.block_keys(acme, cache_salt="s1") == acme_salted
    assert set(await gateway.block_keys(globex, cache_salt="s1")).isdisjoint(acme_salted)


async def test_tenants_of_one_cache_group_share_and_a_group_change_reaches_the_gateway(gateway: Gateway) -> None:
    _, initech = await gateway.tenant("initech", cache_group="labs")
    _, umbrella = await gateway.tenant("umbrella", cache_group="labs")
    hooli_id, hooli = await gateway.tenant("hooli")
    shared = await gateway.block_keys(initech)
    assert await gateway.block_keys(umbrella) == shared
    assert await gateway.block_keys(initech, cache_salt="x") == await gateway.block_keys(umbrella, cache_salt="x")
    hooli_keys = await gateway.block_keys(hooli)  # cached by the key store: a change must drop it
    assert set(hooli_keys).isdisjoint(shared)
    status, body = await gateway.call("PATCH", f"/admin/v1/tenants/{hooli_id}", ADMIN_KEY, {"cache_group": "labs"})
    assert (status, body["cache_group"]) == (200, "labs")
    assert await gateway.block_keys(hooli) == shared
    status, body = await gateway.call("PATCH", f"/admin/v1/tenants/{hooli_id}", ADMIN_KEY, {"cache_group": ""})
    assert (status, body["cache_group"]) == (200, None)
    assert await gateway.block_keys(hooli) == hooli_keys


def requests_by_tenant(text: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvmesh_gateway_requests_total":
                tenant = sample.labels["tenant"]
                totals[tenant] = totals.get(tenant, 0.0) + sample.value
    return totals


async def test_metrics_name_the_busiest_tenants_and_the_rest_other(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telemetry, "TENANT_LABELS", TenantLabels(2, telemetry.forget_tenant))  # N = 2 from here
    names = [f"metered-{i}" for i in range(4)]  # N + 2 tenants
    keys = [(await gateway.tenant(name))[1] for name in names]
    async with gateway.session.get(f"{gateway.base_url}/metrics", headers=ADMIN_HEADERS) as response:
        before = requests_by_tenant(await response.text())
    for key, num_requests in zip(keys, (3, 2, 1, 1), strict=True):
        for _ in range(num_requests):
            await gateway.block_keys(key)
    async with gateway.session.get(f"{gateway.base_url}/metrics", headers=ADMIN_HEADERS) as response:
        text = await response.text()
    after = requests_by_tenant(text)
    assert {name: after.get(name) for name in names} == {names[0]: 3, names[1]: 2, names[2]: None, names[3]: None}
    assert after["other"] - before.get("other", 0.0) == 2
    prompt = f'kvmesh_gateway_tokens_total{{kind="prompt",model="{MODEL}",tenant="{names[1]}"}}'
    num_prompt_tokens = len(gateway.fakes.script.prefills[0].prompt_token_ids)
    assert f"{prompt} {2 * num_prompt_tokens}.0" in text
    vllm_named = f'kvmesh:request_prompt_tokens_sum{{model_name="{MODEL}",tenant="{names[1]}"}}'
    assert f"{vllm_named} {2 * num_prompt_tokens}.0" in text  # the vLLM-named histograms: the same tenant labels
    assert all(key not in text for key in keys)  # names, never keys
    for _ in range(3):  # the 4th tenant's 3rd request overtakes the 2nd (2): the 2nd's series go, `other` counts it
        await gateway.block_keys(keys[3])
    await gateway.block_keys(keys[1])
    async with gateway.session.get(f"{gateway.base_url}/metrics", headers=ADMIN_HEADERS) as response:
        text = await response.text()
    final = requests_by_tenant(text)
    assert {name: final.get(name) for name in names} == {names[0]: 3, names[1]: None, names[2]: None, names[3]: 2}
    assert final["other"] - before.get("other", 0.0) == 4  # the 3rd's 1st, the 4th's 1st and 2nd, the 2nd's 3rd
    assert f'tenant="{names[1]}"' not in text
