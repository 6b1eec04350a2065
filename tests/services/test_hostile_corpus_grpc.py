"""The hostile-input corpus of the internal ports (tests/hostile/grpc.jsonl): truncated, malformed and oversized
protobufs, sent as raw bytes with a generic channel (no serializer) to every internal gRPC method of the real
services, each started in this process as its own tests start it (balancer, kvcache, expert_lb and encoder through
harness.serving; prefill and decode as pd_harness starts them, on deepseek-tiny). A caller the access table allows
gets an error status from the parse (or RESOURCE_EXHAUSTED over the 64 MiB limit) within 2 s; a caller it refuses
gets PERMISSION_DENIED before anything is parsed; and every server answers a well-formed call afterwards."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from engine_core import model_store
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import rpc, tls
from mesh.access import ALLOWED_CALLERS, BALANCER, DECODE, ENCODER, GATEWAY, PREFILL, ROLES
from mesh.config import load_settings
from mesh.pb import (
    balancer_pb2,
    balancer_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    encoder_pb2,
    encoder_pb2_grpc,
    expert_lb_pb2,
    expert_lb_pb2_grpc,
    health_pb2,
    health_pb2_grpc,
    kvcache_pb2,
    kvcache_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.balancer.config import BalancerSettings
from services.balancer.server import serve as serve_balancer
from services.decode.config import DecodeSettings
from services.decode.server import DecodeService
from services.encoder.config import EncoderSettings
from services.encoder.server import serve as serve_encoder
from services.expert_lb.config import ExpertLBSettings
from services.expert_lb.server import serve as serve_expert_lb
from services.kvcache.config import KVCacheSettings
from services.kvcache.server import serve as serve_kvcache
from services.prefill.config import PrefillSettings
from services.prefill.server import PrefillService

from .harness import serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

CORPUS = Path(__file__).parents[1] / "hostile" / "grpc.jsonl"
MODEL = "deepseek-tiny"
DEADLINE_S = 2.0
REFUSED_CALLER = ENCODER  # the access table lets the encoder call nothing
PB_MODULES = (balancer_pb2, decode_pb2, encoder_pb2, expert_lb_pb2, health_pb2, kvcache_pb2, prefill_pb2)


def load_corpus() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Method:
    path: str  # /kvmesh.v1.Decode/PushKV
    client_streaming: bool
    server_streaming: bool

    @property
    def service(self) -> str:
        return self.path.split("/")[1].removeprefix("kvmesh.v1.").removeprefix("grpc.health.v1.")

    @property
    def allowed_caller(self) -> str:
        return sorted(ALLOWED_CALLERS[self.path])[0]


def internal_methods() -> list[Method]:
    """Every method of proto/kvmesh/v1 but the gateway's public API, and the health check every server answers,
    from the compiled descriptors."""
    methods = []
    for module in PB_MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                methods.append(Method(path, method.client_streaming, method.server_streaming))
    return sorted(methods, key=lambda method: method.path)


def payload(spec: Any) -> bytes:
    if isinstance(spec, str):
        return bytes.fromhex(spec)
    if "oversized" in spec:
        return b"\x0a" + bytes(spec["oversized"] - 1)  # field 1's tag, then zeros: too big before it is parsed
    return bytes.fromhex(spec["hex"]) * spec["times"]


async def call_raw(channel: grpc.aio.Channel, method: Method, data: bytes) -> tuple[grpc.StatusCode, float]:
    """Send `data` as the request (as the one message of a stream where the method takes one); the status and
    the seconds it took."""
    start = time.monotonic()
    path = method.path
    try:
        if method.client_streaming:
            await channel.stream_unary(path)(iter([data]), timeout=10)
        elif method.server_streaming:
            async for _ in channel.unary_stream(path)(data, timeout=10):
                pass
        else:
            await channel.unary_unary(path)(data, timeout=10)
    except grpc.aio.AioRpcError as error:
        return error.code(), time.monotonic() - start
    return grpc.StatusCode.OK, time.monotonic() - start


# ---- the real services ------------------------------------------------------------------------------------------


@dataclass
class Servers:
    addresses: dict[str, str]  # service name (as in the proto) -> host:port
    channels: dict[str, rpc.Channels]  # caller role -> its channels

    def channel(self, service: str, role: str) -> grpc.aio.Channel:
        return self.channels[role].get(self.addresses[service])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers() -> AsyncIterator[Servers]:
    model_dir = str(model_store.ensure(MODEL))
    with EmbeddedNats() as nats:
        async with contextlib.AsyncExitStack() as stack:
            common: dict[str, Any] = {"nats_url": nats.url, "heartbeat_interval_s": 0.5, "log_level": "warning"}

            def ports() -> dict[str, Any]:
                return {"grpc_port": free_port(), "http_port": free_port()}

            started: dict[str, tuple[Any, Any]] = {
                "Balancer": (serve_balancer, BalancerSettings(worker_id="balancer-h", **ports(), **common)),
                "KVCache": (serve_kvcache, KVCacheSettings(worker_id="kvcache-h", **ports(), **common)),
                "ExpertBalancer": (serve_expert_lb, ExpertLBSettings(worker_id="expert-lb-h", **ports(), **common)),
                "Encoder": (
                    serve_encoder,
                    EncoderSettings(worker_id="encoder-h", models=(MODEL,), **ports(), **common),
                ),
            }
            addresses = {}
            for name, (serve, settings) in started.items():
                await stack.enter_async_context(serving(serve, settings))
                addresses[name] = f"127.0.0.1:{settings.grpc_port}"
            engines = {"models": (model_dir,), "kv_cache_memory_bytes": 2 * 2**20, "drain_timeout_s": 1.0, **common}
            decode = await DecodeService.start(load_settings(DecodeSettings, env={}, worker_id="decode-h", **engines))
            stack.push_async_callback(decode.stop)
            prefill = await PrefillService.start(
                load_settings(PrefillSettings, env={}, worker_id="prefill-h", kv_index_enabled=False, **engines)
            )
            stack.push_async_callback(prefill.stop)
            addresses["Decode"] = decode.runtime.address
            addresses["Prefill"] = prefill.runtime.address
            addresses["Health"] = decode.runtime.address  # every server answers it: decode's stands for them
            channels = {role: rpc.Channels(tls.load_credentials(role)) for role in ROLES}
            for role_channels in channels.values():
                stack.push_async_callback(role_channels.close)
            yield Servers(addresses, channels)


async def well_formed_call(servers: Servers, service: str) -> str:
    """One ordinary call to `service`, as its allowed caller: what it answered, in words."""
    if service == "Balancer":
        workers = await balancer_pb2_grpc.BalancerStub(servers.channel(service, GATEWAY)).ListWorkers(
            balancer_pb2.ListWorkersRequest()
        )
        return f"ListWorkers: {type(workers).__name__}"
    if service == "KVCache":
        lookup = await kvcache_pb2_grpc.KVCacheStub(servers.channel(service, PREFILL)).Lookup(
            kvcache_pb2.LookupRequest(model=MODEL, block_hashes=[b"\x01" * 16])
        )
        return f"Lookup: {lookup.num_hits} hits"
    if service == "Health":
        checked = await health_pb2_grpc.HealthStub(servers.channel(service, BALANCER)).Check(
            health_pb2.HealthCheckRequest(service="decode-h")
        )
        return f"Check: {health_pb2.HealthCheckResponse.ServingStatus.Name(checked.status)}"
    if service == "Decode":
        aborted = await decode_pb2_grpc.DecodeStub(servers.channel(service, GATEWAY)).Abort(
            decode_pb2.AbortRequest(request_id="no-such-request")
        )
        return f"Abort: {aborted.aborted}"
    return await refused_by_the_handler(servers, service)


async def refused_by_the_handler(servers: Servers, service: str) -> str:
    """A call the handler itself answers with an error naming what it lacks: proof that it ran."""
    try:
        if service == "ExpertBalancer":
            await expert_lb_pb2_grpc.ExpertBalancerStub(servers.channel(service, DECODE)).GetPlan(
                expert_lb_pb2.GetPlanRequest(model="no-such-model")
            )
        elif service == "Encoder":
            await encoder_pb2_grpc.EncoderStub(servers.channel(service, GATEWAY)).Encode(
                encoder_pb2.EncodeRequest(model="no-such-model", image=b"x")
            )
        else:
            await prefill_pb2_grpc.PrefillStub(servers.channel(service, GATEWAY)).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="r-1", model="no-such-model", prompt_token_ids=[1, 2], decode_address="127.0.0.1:9"
                )
            )
    except grpc.aio.AioRpcError as error:
        return f"{error.code().name}: {'no-such-model' in (error.details() or '')}"
    return "OK"


WELL_FORMED = {
    "Balancer": "ListWorkers: ListWorkersResponse",
    "KVCache": "Lookup: 0 hits",
    "Decode": "Abort: False",
    "ExpertBalancer": "NOT_FOUND: True",
    "Encoder": "NOT_FOUND: True",
    "Prefill": "NOT_FOUND: True",
    "Health": "Check: SERVING",
}


def status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field_name + ":")).split()[1])


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := VmRSS


# ---- the tests --------------------------------------------------------------------------------------------------


async def test_every_internal_method_is_in_the_access_table_and_has_a_server() -> None:
    paths = [method.path for method in internal_methods()]
    assert len(paths) == 16
    assert set(paths) == set(ALLOWED_CALLERS)
    assert {method.service for method in internal_methods()} == set(WELL_FORMED)
    assert all(REFUSED_CALLER not in roles for roles in ALLOWED_CALLERS.values())


async def test_the_services_answer_well_formed_calls(servers: Servers) -> None:
    answers = {service: await well_formed_call(servers, service) for service in WELL_FORMED}
    assert answers == WELL_FORMED


async def test_every_case_to_every_method_is_refused_in_time_and_the_servers_keep_serving(servers: Servers) -> None:
    corpus = load_corpus()
    assert len(corpus) == 8
    outcomes: dict[tuple[str, str], tuple[str, float]] = {}
    rss_before = status_kib("VmRSS")
    reset_peak()
    for case in corpus:
        data = payload(case["request"]["bytes"])
        for method in internal_methods():
            caller = method.allowed_caller if case["request"]["caller"] == "allowed" else REFUSED_CALLER
            code, seconds = await call_raw(servers.channel(method.service, caller), method, data)
            outcomes[(case["name"], method.path)] = (code.name, seconds)
        del data
    wrong = {
        key: outcome
        for key, outcome in outcomes.items()
        if outcome[0] not in next(c for c in corpus if c["name"] == key[0])["expect"]["codes"]
        or outcome[1] >= DEADLINE_S
    }
    slowest = max(outcomes.items(), key=lambda item: item[1][1])
    peak_growth_mib = (status_kib("VmHWM") - rss_before) // 1024  # clients and servers: one process
    print(
        json.dumps({"num_calls": len(outcomes), "slowest": [*slowest[0], slowest[1][1]], "peak_mib": peak_growth_mib})
    )
    assert wrong == {}
    answers = {service: await well_formed_call(servers, service) for service in WELL_FORMED}
    assert answers == WELL_FORMED
