"""The gateway over real loopback gRPC and a real NATS, against test doubles of the balancer, prefill and
decode contracts (scripted tokens; one gRPC server plays every worker). The OpenAI SDK, raw HTTP and the
Gateway gRPC API as clients. The real mesh is tested in tests/integration/."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import grpc.aio
import openai
import pytest
import pytest_asyncio

from engine_core import model_store
from engine_core.kv_cache.block_hash import hash_token_blocks, root_hash
from kvmesh.nats_server import EmbeddedNats
from mesh import rpc
from mesh.bus import Bus
from mesh.discovery import Announcer
from mesh.pb import (
    balancer_pb2,
    balancer_pb2_grpc,
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.gateway.catalog import ModelCatalog, ServedModel, load_model
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-test-7b3e1f"
MODEL = "deepseek-tiny"
IDLE_MODEL = "idle-model"  # the gateway can tokenize it, but no worker serves it
PREFILLS = ("prefill-a", "prefill-b")
DECODES = ("decode-a", "decode-b")
NUM_CACHED = 16
COMPLETION = "Hello world. Bye now"


@dataclass
class Script:
    """What the fake workers do, and what they saw. Reset before every test."""

    token_ids: list[int] = field(default_factory=list)  # the completion: prefill's first, then decode's
    finish_reason: int = common_pb2.FINISH_REASON_LENGTH
    batch_size: int = 2
    batch_delay_s: float = 0.0
    prefill_failures: list[tuple[grpc.StatusCode, str | None]] = field(default_factory=list)
    decode_error_after: int | None = None  # fail the stream with UNAVAILABLE after this many batches
    decode_errors: int = 1_000  # ... this many times (then streams run to the end)
    offsets: dict[str, int] = field(default_factory=dict)  # request id -> output tokens its prompt already holds
    prefill_delay_s: float = 0.0
    prefill_ends: list[str] = field(default_factory=list)  # "finished" | "cancelled"
    routes: list[balancer_pb2.RouteRequest] = field(default_factory=list)
    prefills: list[prefill_pb2.PrefillRequest] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)  # request ids followed
    stream_ends: list[str] = field(default_factory=list)  # "finished" | "cancelled"
    aborts: list[str] = field(default_factory=list)  # may include late aborts of an earlier test's requests

    def own_aborts(self) -> list[str]:
        ids = {prefill.request_id for prefill in self.prefills}
        return [request_id for request_id in self.aborts if request_id in ids]


class Fakes(balancer_pb2_grpc.BalancerServicer, prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer):
    def __init__(self) -> None:
        self.script = Script()
        self.address = ""

    def info(self, worker_id: str, role: int) -> common_pb2.WorkerInfo:
        return common_pb2.WorkerInfo(
            worker_id=worker_id,
            role=role,
            address=self.address,  # type: ignore[arg-type]
            models=[MODEL],
            block_size=16,
        )

    async def Route(self, request: balancer_pb2.RouteRequest, context: Any) -> balancer_pb2.RouteResponse:
        self.script.routes.append(request)
        prefill = next((w for w in PREFILLS if w not in request.exclude_worker_ids), None)
        decode = next((w for w in DECODES if w not in request.exclude_worker_ids), None)
        if prefill is None or decode is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "every worker is excluded")
        assert prefill is not None and decode is not None
        return balancer_pb2.RouteResponse(
            prefill=self.info(prefill, common_pb2.ROLE_PREFILL), decode=self.info(decode, common_pb2.ROLE_DECODE)
        )

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        self.script.prefills.append(request)
        if self.script.prefill_failures:
            code, failed_worker = self.script.prefill_failures.pop(0)
            if failed_worker:
                context.set_trailing_metadata((("kvmesh-failed-worker", failed_worker),))
            await context.abort(code, "scripted failure")
        try:
            await asyncio.sleep(self.script.prefill_delay_s)
        except asyncio.CancelledError:
            self.script.prefill_ends.append("cancelled")
            raise
        self.script.prefill_ends.append("finished")
        # a migrated request comes with the output so far: answer from where it stopped
        offset = len(request.output_token_ids)
        self.script.offsets[request.request_id] = offset
        ids = self.script.token_ids[offset:]
        finish_reason: Any = self.script.finish_reason if len(ids) == 1 else 0
        return prefill_pb2.PrefillResponse(
            worker_id="prefill",
            first_token_id=ids[0],
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=NUM_CACHED,
            finish_reason=finish_reason,
        )

    async def PrefillStream(
        self, request: prefill_pb2.PrefillRequest, context: Any
    ) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        first = await self.Prefill(request, context)
        first.kv_pending = True
        yield first
        yield prefill_pb2.PrefillResponse(worker_id="prefill", kv_bytes_sent=1)

    async def Stream(self, request: decode_pb2.StreamRequest, context: Any) -> AsyncIterator[decode_pb2.TokenBatch]:
        script = self.script
        script.streams.append(request.request_id)
        offset = script.offsets.get(request.request_id, 0)
        rest = script.token_ids[offset + 1 :]
        try:
            for number, start in enumerate(range(0, len(rest), script.batch_size)):
                if script.decode_error_after == number and script.decode_errors > 0:
                    script.decode_errors -= 1
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted decode failure")
                await asyncio.sleep(script.batch_delay_s)
                batch = rest[start : start + script.batch_size]
                finish_reason: Any = script.finish_reason if start + script.batch_size >= len(rest) else 0
                yield decode_pb2.TokenBatch(
                    token_ids=batch, finish_reason=finish_reason, num_output_tokens=offset + 1 + start + len(batch)
                )
            script.stream_ends.append("finished")
        except asyncio.CancelledError:
            script.stream_ends.append("cancelled")
            raise

    async def Abort(self, request: decode_pb2.AbortRequest, context: Any) -> decode_pb2.AbortResponse:
        self.script.aborts.append(request.request_id)
        return decode_pb2.AbortResponse(aborted=True)


@dataclass
class Mesh:
    fakes: Fakes
    gateway: GatewayServer
    model: ServedModel
    base_url: str
    grpc_address: str

    @property
    def script(self) -> Script:
        return self.fakes.script

    def client(self, key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=20)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    model = load_model(str(model_store.ensure(MODEL)))
    model = ServedModel(MODEL, model.tokenizer, model.context_len)
    catalog = ModelCatalog([model, ServedModel(IDLE_MODEL, model.tokenizer, 4096)])
    with EmbeddedNats() as nats:
        fakes = Fakes()
        server = rpc.create_server()
        balancer_pb2_grpc.add_BalancerServicer_to_server(fakes, server)
        prefill_pb2_grpc.add_PrefillServicer_to_server(fakes, server)
        decode_pb2_grpc.add_DecodeServicer_to_server(fakes, server)
        fakes.address = f"127.0.0.1:{rpc.bind(server, '127.0.0.1', 0)}"
        await server.start()
        bus = await Bus.connect(nats.url, name="fake-workers")
        workers = (
            [("balancer-0", common_pb2.ROLE_BALANCER)]
            + [(w, common_pb2.ROLE_PREFILL) for w in PREFILLS]
            + [(w, common_pb2.ROLE_DECODE) for w in DECODES]
        )
        announcers = [Announcer(bus, fakes.info(w, role), common_pb2.WorkerLoad, 0.5) for w, role in workers]
        settings = GatewaySettings(
            nats_url=nats.url,
            http_port=0,
            grpc_port=0,
            api_keys=(KEY, "sk-other"),
            models=(MODEL, IDLE_MODEL),
            heartbeat_interval_s=0.5,
            log_level="warning",
        )
        gateway = GatewayServer(settings, catalog=catalog)
        await gateway.start()
        for announcer in announcers:
            await announcer.start()
        base_url = f"http://127.0.0.1:{gateway.http_port}"
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                async with session.get(f"{base_url}/readyz") as response:
                    if response.status == 200:
                        break
                await asyncio.sleep(0.05)
        try:
            yield Mesh(fakes, gateway, model, base_url, f"127.0.0.1:{gateway.grpc_port}")
        finally:
            for announcer in announcers:
                await announcer.stop()
            await gateway.stop()
            await bus.close()
            await server.stop(grace=None)


@pytest.fixture
def script(mesh: Mesh) -> Script:
    mesh.fakes.script = Script(token_ids=mesh.model.tokenizer.encode(COMPLETION, add_special_tokens=False))
    return mesh.fakes.script


def prompt_ids(mesh: Mesh, content: str = "Hi") -> list[int]:
    return mesh.model.render_chat([{"role": "user", "content": content}])


async def post(
    mesh: Mesh, body: Any, key: str | None = KEY, headers: dict[str, str] | None = None
) -> tuple[int, Mapping[str, str], bytes]:
    all_headers = {"Authorization": f"Bearer {key}"} if key else {}
    all_headers.update(headers or {})
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{mesh.base_url}/v1/chat/completions", data=data, headers=all_headers) as response:
            return response.status, response.headers.copy(), await response.read()


def sse_events(raw: bytes) -> list[Any]:
    frames = raw.decode().split("\n\n")
    assert frames[-1] == ""
    assert all(frame.startswith("data: ") for frame in frames[:-1])
    return [
        frame[len("data: ") :] if frame == "data: [DONE]" else json.loads(frame[len("data: ") :])
        for frame in frames[:-1]
    ]


# ---- OpenAI SDK -----------------------------------------------------------------------------------------


async def test_sdk_completion(mesh: Mesh, script: Script) -> None:
    raw = await mesh.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=50, temperature=0.5, top_p=0.9, seed=7
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == COMPLETION
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "length"
    num_prompt = len(prompt_ids(mesh))
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        num_prompt,
        len(script.token_ids),
        num_prompt + len(script.token_ids),
    )
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == NUM_CACHED
    assert raw.headers["x-kvmesh-prefill-worker"] == "prefill-a"
    assert raw.headers["x-kvmesh-decode-worker"] == "decode-a"
    request_id = raw.headers["x-request-id"]
    assert completion.id == f"chatcmpl-{request_id}"
    # what the workers were asked
    (route,) = script.routes
    assert route.request_id == request_id and route.model == MODEL
    assert route.num_prompt_tokens == num_prompt and list(route.exclude_worker_ids) == []
    assert list(route.block_hashes) == hash_token_blocks(root_hash(MODEL), prompt_ids(mesh), 16)
    (prefill,) = script.prefills
    assert list(prefill.prompt_token_ids) == prompt_ids(mesh)
    assert prefill.sampling == common_pb2.SamplingParams(
        temperature=0.5, top_p=0.9, max_tokens=50, seed=7, repetition_penalty=1.0
    )
    assert (prefill.decode_worker_id, prefill.decode_address) == ("decode-a", mesh.fakes.address)
    await wait_for(lambda: script.stream_ends)  # the fake's generator ends just after its last message is read
    assert script.streams == [request_id] and script.stream_ends == ["finished"]


async def test_sdk_stream_with_usage(mesh: Mesh, script: Script) -> None:
    script.finish_reason = common_pb2.FINISH_REASON_STOP
    stream = await mesh.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0].choices == []
    usage = usage_chunks[0].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids(mesh)), len(script.token_ids))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == COMPLETION
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


async def test_sdk_unknown_model(mesh: Mesh, script: Script) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await mesh.client().chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert script.routes == []


async def test_sdk_bad_key(mesh: Mesh, script: Script) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await mesh.client(key="sk-wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.code == "invalid_api_key"
    assert "sk-wrong" not in str(caught.value.body)
    models = await mesh.client(key="sk-other").models.list()  # every configured key works
    assert [m.id for m in models.data] == [MODEL]


# ---- raw HTTP ------------------------------------------------------------------------------------------


async def test_stream_without_usage_option(mesh: Mesh, script: Script) -> None:
    status, headers, raw = await post(
        mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 50}
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert headers["x-kvmesh-prefill-worker"] == "prefill-a" and headers["x-kvmesh-decode-worker"] == "decode-a"
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" not in chunk for chunk in chunks)
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == COMPLETION


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"},
            400,
            "temperature",
            None,
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 9}, 400, "n", None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, 400, "max_tokens", None),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16384},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**6},
            400,
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "word " * 17000}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages[0].role", None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stop": ["a"] * 5}, 400, "stop", None),
        ({"model": "gpt-17", "messages": [{"role": "user", "content": "Hi"}]}, 404, "model", "model_not_found"),
        ({"model": IDLE_MODEL, "messages": [{"role": "user", "content": "Hi"}]}, 503, None, "service_unavailable"),
        (b"{not json", 400, None, None),
        (b"[1, 2]", 400, None, None),
    ],
)
async def test_bad_requests(
    mesh: Mesh, script: Script, body: Any, status: int, param: str | None, code: str | None
) -> None:
    got_status, headers, raw = await post(mesh, body)
    error = json.loads(raw)["error"]
    assert (got_status, error["param"], error["code"]) == (status, param, code)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert headers["x-request-id"]
    assert script.routes == []


async def test_missing_key(mesh: Mesh, script: Script) -> None:
    status, _, raw = await post(mesh, {"model": MODEL, "messages": []}, key=None)
    assert status == 401
    assert json.loads(raw) == {
        "error": {
            "message": "Missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key'.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


async def test_client_request_id_is_echoed(mesh: Mesh, script: Script) -> None:
    status, headers, _ = await post(
        mesh,
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        headers={"x-request-id": "client-req-42"},
    )
    assert status == 200 and headers["x-request-id"] == "client-req-42"
    assert script.prefills[0].request_id.startswith("client-req-42-")  # unique in the mesh


async def test_stop_string_ends_the_stream_and_cancels_decode(mesh: Mesh, script: Script) -> None:
    script.batch_size = 1
    script.batch_delay_s = 0.05
    status, _, raw = await post(
        mesh,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stop": ["Bye"],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1] if c["choices"])
    assert content == "Hello world. "
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == 5  # Hello, world, ., By, e
    await wait_for(lambda: script.stream_ends)
    assert script.stream_ends == ["cancelled"]


async def test_stop_string_in_the_first_token_aborts_decode(mesh: Mesh, script: Script) -> None:
    status, _, raw = await post(
        mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stop": "Hello"}
    )
    body = json.loads(raw)
    assert status == 200 and body["choices"][0]["message"]["content"] == ""
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 1
    await wait_for(lambda: script.own_aborts())
    assert script.streams == [] and script.own_aborts() == [script.prefills[0].request_id]


async def test_prefill_finishing_the_request_skips_decode(mesh: Mesh, script: Script) -> None:
    script.token_ids = script.token_ids[:1]
    script.finish_reason = common_pb2.FINISH_REASON_STOP
    status, _, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    body = json.loads(raw)
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    await asyncio.sleep(0.05)
    assert script.streams == [] and script.own_aborts() == []


async def test_retry_excludes_the_failed_decode_worker(mesh: Mesh, script: Script) -> None:
    script.prefill_failures = [(grpc.StatusCode.UNAVAILABLE, "decode-a")]
    status, headers, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == COMPLETION
    assert [list(r.exclude_worker_ids) for r in script.routes] == [[], ["decode-a"]]
    first, second = script.prefills
    assert second.request_id == f"{first.request_id}.1" and second.decode_worker_id == "decode-b"
    assert (headers["x-kvmesh-prefill-worker"], headers["x-kvmesh-decode-worker"]) == ("prefill-a", "decode-b")
    assert script.streams == [second.request_id]


async def test_retries_exhausted_is_a_429(mesh: Mesh, script: Script) -> None:
    script.prefill_failures = [(grpc.StatusCode.RESOURCE_EXHAUSTED, None)] * 3  # max_retries is 2
    status, headers, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 429 and headers["retry-after"] == "1"
    assert json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    # the third route finds every prefill worker excluded: the client hears the prefill's reason, not the route's
    assert [list(r.exclude_worker_ids) for r in script.routes] == [[], ["prefill-a"], ["prefill-a", "prefill-b"]]
    assert len(script.prefills) == 2


async def test_worker_rejection_is_a_400(mesh: Mesh, script: Script) -> None:
    script.prefill_failures = [(grpc.StatusCode.INVALID_ARGUMENT, None)]
    status, _, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400 and json.loads(raw)["error"]["message"] == "scripted failure"
    assert len(script.prefills) == 1


async def test_error_after_the_stream_started_is_an_sse_frame(mesh: Mesh, script: Script) -> None:
    script.decode_error_after = 0  # every decode stream fails: the first attempt, then both migrations
    status, _, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True})
    events = sse_events(raw)
    assert status == 200 and events[-1] != "[DONE]"
    assert events[-1]["error"]["code"] == "service_unavailable"
    assert events[-1]["error"]["type"] == "server_error"
    assert len(script.routes) == 3  # max_retries is 2


async def test_a_decode_failure_mid_stream_migrates_and_the_output_goes_on(mesh: Mesh, script: Script) -> None:
    script.decode_error_after, script.decode_errors = 1, 1
    status, headers, raw = await post(
        mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    )
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == COMPLETION
    first_decode = headers["x-kvmesh-decode-worker"]
    # the second attempt: routed without the failed decode worker, with the first's prompt and, as its output so
    # far, the 3 tokens sent (prefill's, then decode's first batch of 2)
    assert [list(r.exclude_worker_ids) for r in script.routes] == [[], [first_decode]]
    assert script.prefills[1].prompt_token_ids == script.prefills[0].prompt_token_ids
    assert list(script.prefills[1].output_token_ids) == script.token_ids[:3]
    assert script.routes[1].num_prompt_tokens == script.routes[0].num_prompt_tokens + 3  # prefill computes them too
    assert script.prefills[1].request_id == script.prefills[0].request_id + ".m1"


async def wait_for(condition: Any, timeout_s: float = 3.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)


async def test_client_leaving_cancels_the_decode_stream(mesh: Mesh, script: Script) -> None:
    script.batch_size = 1
    script.batch_delay_s = 0.3
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{mesh.base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
        ) as response,
    ):
        for _ in range(3):  # role, "Hello" (prefill's token), " world" (decode's first batch)
            await response.content.readuntil(b"\n\n")
        response.close()
    await wait_for(lambda: script.stream_ends and script.own_aborts())
    assert script.stream_ends == ["cancelled"]
    assert script.own_aborts() == [script.prefills[0].request_id]  # in case the cancel raced the call's start


async def test_client_leaving_during_prefill_cancels_it(mesh: Mesh, script: Script) -> None:
    script.prefill_delay_s = 5.0
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(
                f"{mesh.base_url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
                timeout=aiohttp.ClientTimeout(total=0.5),
            )
    await wait_for(lambda: script.prefill_ends and script.own_aborts())
    assert script.prefill_ends == ["cancelled"]
    assert script.own_aborts() == [script.prefills[0].request_id]  # the KV may have reached decode already
    assert script.streams == []


async def test_models_health_ready_metrics(mesh: Mesh, script: Script) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{mesh.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as response:
            body = await response.json()
        assert body["object"] == "list"
        assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
            (MODEL, "model", "kvmesh", mesh.model.context_len)
        ]
        async with session.get(f"{mesh.base_url}/v1/models") as response:
            assert response.status == 401
        for path in ("/healthz", "/readyz"):
            async with session.get(f"{mesh.base_url}{path}") as response:
                assert response.status == 200
        async with session.get(f"{mesh.base_url}/metrics") as response:
            text = await response.text()
        assert 'kvmesh_gateway_requests_total{api="chat.completions",code="200",model="deepseek-tiny"}' in text
        assert "kvmesh_gateway_time_to_first_token_seconds_bucket" in text
        async with session.get(f"{mesh.base_url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 404 and (await response.json())["error"]["code"] == "not_found"


async def test_draining_refuses_new_requests(mesh: Mesh, script: Script) -> None:
    lifecycle = mesh.gateway.runtime.lifecycle
    lifecycle.draining = True
    try:
        status, _, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        async with aiohttp.ClientSession() as session, session.get(f"{mesh.base_url}/readyz") as response:
            ready_status = response.status
    finally:
        lifecycle.draining = False
    assert (status, json.loads(raw)["error"]["code"], ready_status) == (503, "service_unavailable", 503)
    assert script.routes == []


# ---- gRPC ----------------------------------------------------------------------------------------------

AUTH = (("authorization", f"Bearer {KEY}"),)


async def test_grpc_generate(mesh: Mesh, script: Script) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            model=MODEL,
            messages=[gateway_pb2.ChatMessage(role="user", content="Hi")],
            stop=["now"],
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=30),
            cache_salt="tenant-1",
        )
        responses = [r async for r in stub.Generate(request, metadata=AUTH)]
    assert "".join(r.text for r in responses) == "Hello world. Bye "
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (
        len(prompt_ids(mesh)),
        len(script.token_ids),
        NUM_CACHED,
    )
    assert {(r.prefill_worker, r.decode_worker) for r in responses} == {("prefill-a", "decode-a")}
    assert [t for r in responses for t in r.token_ids] == script.token_ids
    (route,) = script.routes
    assert list(route.block_hashes) == hash_token_blocks(root_hash(MODEL, "tenant-1"), prompt_ids(mesh), 16)
    assert script.prefills[0].cache_salt == "tenant-1"


async def test_grpc_token_ids_prompt(mesh: Mesh, script: Script) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(model=MODEL, prompt_token_ids=[5, 6, 7])
        responses = [r async for r in stub.Generate(request, metadata=AUTH)]
    assert "".join(r.text for r in responses) == COMPLETION
    assert list(script.prefills[0].prompt_token_ids) == [5, 6, 7]


@pytest.mark.parametrize(
    ("request_fields", "metadata", "code"),
    [
        ({"model": MODEL, "prompt": "Hi"}, (("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
        ({"model": MODEL, "prompt": "Hi"}, (), grpc.StatusCode.UNAUTHENTICATED),
        ({"model": "gpt-17", "prompt": "Hi"}, AUTH, grpc.StatusCode.NOT_FOUND),
        ({"model": MODEL}, AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": MODEL, "prompt": "Hi", "prompt_token_ids": [1]}, AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": MODEL, "prompt_token_ids": [10**7]}, AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        (
            {"model": MODEL, "prompt": "Hi", "sampling": common_pb2.SamplingParams(top_p=2.0)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"model": IDLE_MODEL, "prompt": "Hi"}, AUTH, grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_grpc_errors(
    mesh: Mesh,
    script: Script,
    request_fields: dict[str, Any],
    metadata: tuple[tuple[str, str], ...],
    code: grpc.StatusCode,
) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(gateway_pb2.GenerateRequest(**request_fields), metadata=metadata):
                pass
    assert caught.value.code() == code
    assert script.routes == []


async def test_grpc_list_models(mesh: Mesh, script: Script) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        response = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=AUTH)
        assert [(m.id, m.max_model_len) for m in response.models] == [(MODEL, mesh.model.context_len)]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListModels(gateway_pb2.ListModelsRequest())
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
