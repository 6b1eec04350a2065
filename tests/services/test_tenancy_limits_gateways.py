"""Limits held by 3 whole gateway replicas sharing one real NATS (tenancy/limits.py): zero overshoot of a token
limit and a concurrency limit under 200 concurrent requests, refusals as 429 with the rate-limit headers before
any body byte (OpenAI's, Anthropic's, gRPC's metadata), clamping, and the remaining headers on success.

The fake workers are gateway_harness's, with a decode that honours max_tokens and counts requests in flight.
Keys resolve to limited principals through GatewayCore.authenticate (the key store's contract), patched here."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import grpc.aio
import pytest
import pytest_asyncio

from engine_core import model_store
from kvmesh.nats_server import EmbeddedNats
from mesh.bus import Bus
from mesh.pb import common_pb2, decode_pb2, gateway_pb2, gateway_pb2_grpc, prefill_pb2
from services.gateway.catalog import ModelCatalog, ServedModel, load_model
from services.gateway.core import GatewayCore
from services.gateway.server import GatewayServer
from services.gateway.tenancy.principal import Limits, Principal

from .gateway_harness import MODEL, Fakes, Script, gateway_settings, wait_for_ready

NUM_REPLICAS = 3
ADMIN_KEY = "sk-admin-limits-5c1e"
COMPLETION_IDS = list(range(1000, 1040))  # the fake completion: up to 40 tokens, cut at max_tokens
PRINCIPALS = {
    "sk-tokens": Limits(tokens_per_minute=2000),
    "sk-concurrency": Limits(max_concurrent=4),
    "sk-small": Limits(requests_per_minute=100, tokens_per_minute=30),
    "sk-messages": Limits(tokens_per_minute=30),
    "sk-grpc": Limits(tokens_per_minute=30),
    "sk-grpc-ok": Limits(tokens_per_minute=1000),
    "sk-spend": Limits(spend_per_day_micros=30_000),
}


class CountingFakes(Fakes):
    """Decode streams exactly max_tokens tokens (the prefill's first included) and counts requests in flight,
    from prefill to the last batch."""

    def __init__(self) -> None:
        super().__init__()
        self.max_tokens: dict[str, int] = {}
        self.num_in_flight = 0
        self.max_in_flight = 0

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        self.max_tokens[request.request_id] = request.sampling.max_tokens
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        return await super().Prefill(request, context)

    async def Stream(self, request: decode_pb2.StreamRequest, context: Any) -> AsyncIterator[decode_pb2.TokenBatch]:
        rest = self.script.token_ids[1 : self.max_tokens[request.request_id]]
        size = self.script.batch_size
        for start in range(0, len(rest), size):
            await asyncio.sleep(self.script.batch_delay_s)
            is_last = start + size >= len(rest)
            if is_last:
                self.num_in_flight -= 1
            yield decode_pb2.TokenBatch(
                token_ids=rest[start : start + size],
                finish_reason=common_pb2.FINISH_REASON_LENGTH if is_last else 0,  # type: ignore[arg-type]
                num_output_tokens=1 + start + len(rest[start : start + size]),
            )


@dataclass
class Replicas:
    fakes: CountingFakes
    gateways: list[GatewayServer]
    model: ServedModel

    def url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.gateways[index % NUM_REPLICAS].http_port}"


def limited_authenticate(original: Any) -> Any:
    """GatewayCore.authenticate, sync or async as the original is, resolving PRINCIPALS' keys first."""

    def limited(key: str | None) -> Principal | None:
        if key not in PRINCIPALS:
            return None
        return Principal("ten_limits", "limits", f"key_{key[3:]}", key, key_limits=PRINCIPALS[key])

    async def authenticate_async(core: GatewayCore, key: str | None) -> Principal | None:
        return limited(key) or await original(core, key)  # type: ignore[no-any-return]

    def authenticate(core: GatewayCore, key: str | None) -> Principal | None:
        return limited(key) or original(core, key)  # type: ignore[no-any-return]

    return authenticate_async if inspect.iscoroutinefunction(original) else authenticate


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas() -> AsyncIterator[Replicas]:
    loaded = load_model(str(model_store.ensure(MODEL)))
    model = ServedModel(MODEL, loaded.tokenizer, loaded.context_len)
    with EmbeddedNats() as nats, pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as state_dir:
        patch.setattr(GatewayCore, "authenticate", limited_authenticate(GatewayCore.authenticate))
        fakes = CountingFakes()
        server = await fakes.serve()
        bus = await Bus.connect(nats.url, name="fake-workers")
        announcers = fakes.announcers(bus)
        # one tenancy database (SQLite) for the 3 replicas, as a shared PostgreSQL would be
        settings = gateway_settings(nats.url, state_dir, admin_key=ADMIN_KEY)
        gateways = [GatewayServer(settings, catalog=ModelCatalog([model])) for _ in range(NUM_REPLICAS)]
        for gateway in gateways:
            await gateway.start()
        for announcer in announcers:
            await announcer.start()
        for gateway in gateways:
            await wait_for_ready(f"http://127.0.0.1:{gateway.http_port}")
        try:
            yield Replicas(fakes, gateways, model)
        finally:
            for announcer in announcers:
                await announcer.stop()
            for gateway in gateways:
                await gateway.stop()
            await bus.close()
            await server.stop(grace=None)


@pytest.fixture
def script(replicas: Replicas) -> Script:
    replicas.fakes.script = Script(token_ids=COMPLETION_IDS, batch_size=8, batch_delay_s=0.05)
    replicas.fakes.max_in_flight = 0
    return replicas.fakes.script


async def post(
    url: str, key: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[int, Mapping[str, str], Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}) as response,
    ):
        return response.status, response.headers.copy(), json.loads(await response.read())


def chat(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}


async def not_near_a_minute_end() -> None:
    """The token windows are minutes: a run that straddled one would count in two."""
    into = time.time() % 60
    if into > 40:
        await asyncio.sleep(60 - into + 0.2)


def seconds_to_window_end(window_s: int, before: float, after: float) -> range:
    """What retry-after may say for a refusal decided between `before` and `after`: the whole seconds to the end
    of the window (a minute, a UTC day) it was decided in, rounded up."""
    return range(math.ceil(window_s - after % window_s), math.ceil(window_s - before % window_s) + 1)


OPENAI_HEADERS = (
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "retry-after",
)


@pytest.mark.asyncio(loop_scope="module")
async def test_three_replicas_never_admit_more_tokens_than_the_limit(replicas: Replicas, script: Script) -> None:
    await not_near_a_minute_end()
    num_prompt = len(replicas.model.render_chat([{"role": "user", "content": "Hi"}]))
    results = await asyncio.gather(*(post(replicas.url(i), "sk-tokens", chat(32)) for i in range(200)))
    served = [body["usage"]["total_tokens"] for status, _, body in results if status == 200]
    refused = [(headers, body) for status, headers, body in results if status == 429]
    assert len(served) + len(refused) == 200
    whole, left = divmod(2000, num_prompt + 32)
    expected = whole * (num_prompt + 32) + (left if left > num_prompt else 0)
    assert sum(served) == expected  # every token reserved was used: the sum admitted is the limit, no more
    for headers, body in refused:
        assert all(name in headers for name in OPENAI_HEADERS), headers
        assert headers["x-ratelimit-limit-tokens"] == "2000"
        assert body["error"]["type"] == "tokens" and body["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.asyncio(loop_scope="module")
async def test_three_replicas_hold_a_concurrency_limit_of_4(replicas: Replicas, script: Script) -> None:
    results = await asyncio.gather(*(post(replicas.url(i), "sk-concurrency", chat(16)) for i in range(200)))
    statuses = [status for status, _, _ in results]
    assert replicas.fakes.max_in_flight == 4
    assert statuses.count(200) >= 4 and statuses.count(200) + statuses.count(429) == 200
    for status, headers, body in results:
        if status == 429:
            assert headers["retry-after"] == "1"
            assert body["error"]["code"] == "concurrency_limit_exceeded"
    # every slot came back: 4 more at once all pass
    for gateway in replicas.gateways:
        assert gateway.limiter is not None
        await gateway.limiter.drain()
    again = await asyncio.gather(*(post(replicas.url(i), "sk-concurrency", chat(4)) for i in range(4)))
    assert [status for status, _, _ in again] == [200] * 4


@pytest.mark.asyncio(loop_scope="module")
async def test_a_partly_fitting_request_runs_clamped_and_says_so(replicas: Replicas, script: Script) -> None:
    await not_near_a_minute_end()
    num_prompt = len(replicas.model.render_chat([{"role": "user", "content": "Hi"}]))
    status, headers, body = await post(replicas.url(0), "sk-small", chat(100))
    assert status == 200
    clamped = 30 - num_prompt  # under the fake's 40 tokens
    assert headers["x-kvmesh-max-tokens-clamped"] == str(clamped)
    assert body["usage"]["completion_tokens"] == clamped and body["choices"][0]["finish_reason"] == "length"
    assert headers["x-ratelimit-remaining-tokens"] == "0" and headers["x-ratelimit-remaining-requests"] == "99"
    before = time.time()
    status, headers, body = await post(replicas.url(1), "sk-small", chat(1))
    after = time.time()
    assert status == 429 and headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(headers["retry-after"]) in seconds_to_window_end(60, before, after)  # the minute's end


@pytest.mark.asyncio(loop_scope="module")
async def test_messages_refusal_has_anthropics_headers_and_body(replicas: Replicas, script: Script) -> None:
    await not_near_a_minute_end()
    body = {"model": MODEL, "max_tokens": 200, "messages": [{"role": "user", "content": "Hi " * 40}]}
    status, headers, answer = await post(replicas.url(2), "sk-messages", body, path="/v1/messages")
    assert status == 429
    assert answer["type"] == "error" and answer["error"]["type"] == "rate_limit_error"
    assert headers["anthropic-ratelimit-tokens-limit"] == "30"
    assert headers["anthropic-ratelimit-tokens-remaining"] == "30"
    assert headers["anthropic-ratelimit-tokens-reset"].endswith("Z") and "retry-after" in headers
    assert "x-ratelimit-limit-tokens" not in headers
    assert replicas.fakes.script.prefills == []  # refused before any work


@pytest.mark.asyncio(loop_scope="module")
async def test_grpc_refusal_is_resource_exhausted_with_the_facts(replicas: Replicas, script: Script) -> None:
    await not_near_a_minute_end()
    request = gateway_pb2.GenerateRequest(model=MODEL, prompt="Hi " * 40)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{replicas.gateways[0].grpc_port}") as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=(("authorization", "Bearer sk-grpc"),))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            _ = [response async for response in call]
    assert failed.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(failed.value.trailing_metadata() or ())
    assert trailing["x-ratelimit-limit-tokens"] == "30" and trailing["x-ratelimit-remaining-tokens"] == "30"


@pytest.mark.asyncio(loop_scope="module")
async def test_grpc_success_tells_what_is_left_in_trailing_metadata(replicas: Replicas, script: Script) -> None:
    await not_near_a_minute_end()
    request = gateway_pb2.GenerateRequest(
        model=MODEL, prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=4)
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{replicas.gateways[1].grpc_port}") as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, metadata=(("authorization", "Bearer sk-grpc-ok"),)
        )
        responses = [response async for response in call]
        trailing = dict(await call.trailing_metadata() or ())
    assert await call.code() is grpc.StatusCode.OK and responses[-1].usage.completion_tokens == 4
    assert trailing["x-ratelimit-limit-tokens"] == "1000"
    assert trailing["x-ratelimit-remaining-tokens"] == str(1000 - 3 - 4)  # what this request reserved


@pytest.mark.asyncio(loop_scope="module")
async def test_limits_set_through_the_admin_api_hold_on_every_replica(replicas: Replicas, script: Script) -> None:
    await not_near_a_minute_end()
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession() as session:
        tenant_body = {"name": "rpm-two", "limits": {"requests_per_minute": 2}}
        async with session.post(f"{replicas.url(0)}/admin/v1/tenants", json=tenant_body, headers=admin) as response:
            assert response.status in (200, 201), await response.text()
            tenant = await response.json()
        key_body = {"tenant": tenant["id"], "name": "k"}
        async with session.post(f"{replicas.url(0)}/admin/v1/keys", json=key_body, headers=admin) as response:
            assert response.status in (200, 201), await response.text()
            key = (await response.json())["key"]
    first, second, third = [await post(replicas.url(i), key, chat(2)) for i in range(3)]
    assert (first[0], second[0], third[0]) == (200, 200, 429)
    assert first[1]["x-ratelimit-limit-requests"] == "2" and first[1]["x-ratelimit-remaining-requests"] == "1"
    assert second[1]["x-ratelimit-remaining-requests"] == "0"
    assert third[1]["x-ratelimit-remaining-requests"] == "0" and third[2]["error"]["type"] == "requests"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_spend_budget_holds_at_the_price_set_through_the_admin_api(replicas: Replicas, script: Script) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    price = {"plan": "default", "model": MODEL, "input_per_mtok": 1000, "cached_input_per_mtok": 1000}
    body = {"prices": [{**price, "output_per_mtok": 1000}]}  # $1,000 per million tokens: 1,000 micro-dollars each
    async with (
        aiohttp.ClientSession() as session,
        session.put(f"{replicas.url(0)}/admin/v1/prices", json=body, headers=admin) as response,
    ):
        assert response.status == 200, await response.text()
    for gateway in replicas.gateways:  # what the price book's next refresh would read
        assert gateway.prices is not None
        await gateway.prices.refresh()
    num_prompt = len(replicas.model.render_chat([{"role": "user", "content": "Hi"}]))
    status, headers, answer = await post(replicas.url(1), "sk-spend", chat(100))
    assert status == 200 and headers["x-kvmesh-max-tokens-clamped"] == str(30 - num_prompt)
    assert answer["usage"]["completion_tokens"] == 30 - num_prompt  # the whole budget: 30 tokens at 1,000 each
    before = time.time()
    status, headers, answer = await post(replicas.url(2), "sk-spend", chat(1))
    after = time.time()
    assert status == 429 and answer["error"]["type"] == "insufficient_quota"
    assert int(headers["retry-after"]) in seconds_to_window_end(86400, before, after)  # the UTC day's end
