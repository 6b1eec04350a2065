"""The gateway over real loopback gRPC and a real NATS, against test doubles of the balancer, prefill and decode
contracts (scripted tokens; one gRPC server plays every worker): the `mesh` fixture (each test file that takes it
starts its own) and the `script` each test sets. The real mesh is tested in tests/integration/."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
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
from kvmesh.nats_server import EmbeddedNats
from mesh import rpc, tls
from mesh.access import BALANCER
from mesh.bus import Bus
from mesh.discovery import Announcer
from mesh.pb import (
    balancer_pb2,
    balancer_pb2_grpc,
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.gateway.catalog import ModelCatalog, ServedModel, load_model
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer

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
    decode_delays: dict[str, float] = field(default_factory=dict)  # decode worker -> its batch delay (a slow one)
    prefill_failures: list[tuple[grpc.StatusCode, str | None]] = field(default_factory=list)
    decode_error_after: int | None = None  # fail the stream with UNAVAILABLE after this many batches
    decode_errors: int = 1_000  # ... this many times (then streams run to the end)
    offsets: dict[str, int] = field(default_factory=dict)  # request id -> output tokens its prompt already holds
    prefill_delay_s: float = 0.0
    push_delays: dict[str, float] = field(default_factory=dict)  # decode worker -> how long a push to it takes
    pushes: list[str] = field(default_factory=list)  # "<request id> finished" | "<request id> cancelled"
    prefill_ends: list[str] = field(default_factory=list)  # "finished" | "cancelled"
    late_binding: bool = False  # Route names prefill only; prefill binds the first decode worker not excluded
    bound: dict[str, str] = field(default_factory=dict)  # late binding: request id -> the decode worker bound
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

    def announcers(self, bus: Bus, interval_s: float = 0.5) -> list[Announcer]:
        """Heartbeats for the balancer, prefill and decode workers these fakes play (start them once serving)."""
        workers = (
            [("balancer-0", common_pb2.ROLE_BALANCER)]
            + [(w, common_pb2.ROLE_PREFILL) for w in PREFILLS]
            + [(w, common_pb2.ROLE_DECODE) for w in DECODES]
        )
        return [Announcer(bus, self.info(w, role), common_pb2.WorkerLoad, interval_s) for w, role in workers]

    async def serve(self) -> grpc.aio.Server:
        """Start one gRPC server on a free local port playing every worker; `address` is where it listens."""
        credentials = tls.load_credentials(BALANCER)  # any role's certificate serves; callers are checked
        server = rpc.create_server(credentials)
        balancer_pb2_grpc.add_BalancerServicer_to_server(self, server)
        prefill_pb2_grpc.add_PrefillServicer_to_server(self, server)
        decode_pb2_grpc.add_DecodeServicer_to_server(self, server)
        self.address = f"127.0.0.1:{rpc.bind(server, '127.0.0.1', 0, credentials)}"
        await server.start()
        return server

    async def Route(self, request: balancer_pb2.RouteRequest, context: Any) -> balancer_pb2.RouteResponse:
        self.script.routes.append(request)
        prefill = next((w for w in PREFILLS if w not in request.exclude_worker_ids), None)
        decode = next((w for w in DECODES if w not in request.exclude_worker_ids), None)
        if prefill is None or decode is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "every worker is excluded")
        assert prefill is not None and decode is not None
        return balancer_pb2.RouteResponse(
            prefill=self.info(prefill, common_pb2.ROLE_PREFILL),
            decode=None if self.script.late_binding else self.info(decode, common_pb2.ROLE_DECODE),
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
        response = prefill_pb2.PrefillResponse(
            worker_id="prefill",
            first_token_id=ids[0],
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=NUM_CACHED,
            finish_reason=finish_reason,
        )
        if not request.decode_address and not finish_reason:  # late binding, as Balancer.BindDecode would
            decode = next(w for w in DECODES if w not in request.exclude_decode_worker_ids)
            self.script.bound[request.request_id] = decode
            response.decode_worker_id, response.decode_address = decode, self.address
        return response

    async def PrefillStream(
        self, request: prefill_pb2.PrefillRequest, context: Any
    ) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        first = await self.Prefill(request, context)
        first.kv_pending = True
        yield first
        try:
            decode = request.decode_worker_id or self.script.bound.get(request.request_id, "")
            await asyncio.sleep(self.script.push_delays.get(decode, 0.0))
        except asyncio.CancelledError:
            self.script.pushes.append(f"{request.request_id} cancelled")
            raise
        self.script.pushes.append(f"{request.request_id} finished")
        yield prefill_pb2.PrefillResponse(worker_id="prefill", kv_bytes_sent=1)

    async def Stream(self, request: decode_pb2.StreamRequest, context: Any) -> AsyncIterator[decode_pb2.TokenBatch]:
        script = self.script
        script.streams.append(request.request_id)
        offset = script.offsets.get(request.request_id, 0)
        rest = script.token_ids[offset + 1 :]
        worker = script.bound.get(request.request_id) or next(
            (p.decode_worker_id for p in script.prefills if p.request_id == request.request_id), ""
        )
        delay_s = script.decode_delays.get(worker, script.batch_delay_s)
        try:
            for number, start in enumerate(range(0, len(rest), script.batch_size)):
                if script.decode_error_after == number and script.decode_errors > 0:
                    script.decode_errors -= 1
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted decode failure")
                await asyncio.sleep(delay_s)
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

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.metrics_port}/metrics"

    def client(self, key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=20)


def gateway_settings(nats_url: str, state_dir: str, **overrides: Any) -> GatewaySettings:
    """A gateway for the scripted workers: any free ports, KEY, MODEL, heartbeats every 0.5 s, the tenancy
    database and server secret under `state_dir` (not the home directory); `overrides` replace any of them."""
    values: dict[str, Any] = dict(
        nats_url=nats_url,
        http_port=0,
        grpc_port=0,
        api_keys=(KEY,),
        state_dir=state_dir,
        models=(MODEL,),
        heartbeat_interval_s=0.5,
        log_level="warning",
    )
    return GatewaySettings(**{**values, **overrides})


async def wait_for_ready(base_url: str, timeout_s: float = 10.0) -> None:
    """Until the gateway's /readyz says 200 (it has heard a balancer and workers), or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(f"{base_url}/readyz") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_mesh(**overrides: Any) -> AsyncIterator[Mesh]:
    """The fake workers and a gateway (`overrides`: its settings) on a NATS of their own, until the block ends."""
    model = load_model(str(model_store.ensure(MODEL)))
    model = ServedModel(MODEL, model.tokenizer, model.context_len)
    catalog = ModelCatalog([model, ServedModel(IDLE_MODEL, model.tokenizer, 4096)])
    with EmbeddedNats() as nats, tempfile.TemporaryDirectory() as state_dir:
        fakes = Fakes()
        server = await fakes.serve()
        bus = await Bus.connect(nats.url, name="fake-workers")
        announcers = fakes.announcers(bus)
        settings = gateway_settings(
            nats.url,
            state_dir,
            **{
                "api_keys": (KEY, "sk-other"),
                "models": (MODEL, IDLE_MODEL),
                "metrics_port": 0,  # /metrics with no key, on its own port (the public one wants the admin key)
                **overrides,
            },
        )
        gateway = GatewayServer(settings, catalog=catalog)
        await gateway.start()
        for announcer in announcers:
            await announcer.start()
        base_url = f"http://127.0.0.1:{gateway.http_port}"
        await wait_for_ready(base_url)
        try:
            yield Mesh(fakes, gateway, model, base_url, f"127.0.0.1:{gateway.grpc_port}")
        finally:
            for announcer in announcers:
                await announcer.stop()
            await gateway.stop()
            await bus.close()
            await server.stop(grace=None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    async with running_mesh() as running:
        yield running


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
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{mesh.base_url}/v1/chat/completions", data=data, headers=all_headers) as response,
    ):
        return response.status, response.headers.copy(), await response.read()


def sse_events(raw: bytes) -> list[Any]:
    frames = raw.decode().split("\n\n")
    assert frames[-1] == ""
    assert all(frame.startswith("data: ") for frame in frames[:-1])
    return [
        frame[len("data: ") :] if frame == "data: [DONE]" else json.loads(frame[len("data: ") :])
        for frame in frames[:-1]
    ]


async def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    """Until `condition()` holds or `timeout_s` of wall time passed (the caller's assert says what was missing).
    A deadline, not a count of sleeps: on a loaded machine each sleep can take far longer than asked."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
