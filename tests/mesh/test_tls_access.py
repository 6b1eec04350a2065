"""Mutual TLS and per-method authorization on a real gRPC server (mesh.rpc over the suite's CA, tests/conftest.py):
the allowed role's call runs; another role's is refused with PERMISSION_DENIED naming the method and the role, and
its handler never runs; a client without a certificate, with one of another CA or in plaintext cannot connect."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY

from kvmesh.certs import CertificateAuthority
from mesh import rpc, tls
from mesh.access import ALLOWED_CALLERS, DECODE, GATEWAY, KVCACHE, PREFILL, ROLES
from mesh.config import TLSSettings
from mesh.pb import (
    balancer_pb2,
    decode_pb2,
    decode_pb2_grpc,
    encoder_pb2,
    expert_lb_pb2,
    gateway_pb2,
    health_pb2,
    kvcache_pb2,
    prefill_pb2,
)


class RecordingDecode(decode_pb2_grpc.DecodeServicer):
    """A Decode service whose handlers (one of each kind) record that they ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def PushKV(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> decode_pb2.PushKVResponse:
        num_messages = 0
        async for _ in request_iterator:
            num_messages += 1
        self.calls.append(f"PushKV:{num_messages}")
        return decode_pb2.PushKVResponse(worker_id="decode-t", num_bytes=num_messages)

    async def Stream(
        self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.TokenBatch]:
        self.calls.append(f"Stream:{request.request_id}")
        for token in (5, 6):
            yield decode_pb2.TokenBatch(token_ids=[token])

    async def Abort(
        self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.AbortResponse:
        self.calls.append(f"Abort:{request.request_id}")
        return decode_pb2.AbortResponse(aborted=True)


@pytest.fixture
async def decode_server() -> AsyncIterator[tuple[str, RecordingDecode]]:
    credentials = tls.load_credentials(DECODE)
    assert credentials is not None
    servicer = RecordingDecode()
    server = rpc.create_server(credentials)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = rpc.bind(server, "127.0.0.1", 0, credentials)
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(grace=None)


def stub_as(channels: rpc.Channels, address: str) -> decode_pb2_grpc.DecodeStub:
    return decode_pb2_grpc.DecodeStub(channels.get(address))


async def push(stub: decode_pb2_grpc.DecodeStub) -> decode_pb2.PushKVResponse:
    async def messages() -> AsyncIterator[decode_pb2.KVPushMessage]:
        yield decode_pb2.KVPushMessage(header=decode_pb2.KVPushHeader(request_id="r1"))
        yield decode_pb2.KVPushMessage(chunk=decode_pb2.KVChunk(layer=0))

    response: decode_pb2.PushKVResponse = await stub.PushKV(messages(), timeout=5)
    return response


async def test_each_kind_of_call_runs_for_its_allowed_role(decode_server) -> None:
    address, servicer = decode_server
    as_gateway, as_prefill = rpc.Channels(tls.load_credentials(GATEWAY)), rpc.Channels(tls.load_credentials(PREFILL))
    try:
        aborted = await stub_as(as_gateway, address).Abort(decode_pb2.AbortRequest(request_id="r1"), timeout=5)
        batches = [b async for b in stub_as(as_gateway, address).Stream(decode_pb2.StreamRequest(request_id="r1"))]
        pushed = await push(stub_as(as_prefill, address))
    finally:
        await as_gateway.close()
        await as_prefill.close()
    assert aborted == decode_pb2.AbortResponse(aborted=True)
    assert [list(b.token_ids) for b in batches] == [[5], [6]]
    assert pushed == decode_pb2.PushKVResponse(worker_id="decode-t", num_bytes=2)
    assert servicer.calls == ["Abort:r1", "Stream:r1", "PushKV:2"]


def denied(method: str, role: str) -> float:
    value = REGISTRY.get_sample_value("kvmesh_grpc_calls_denied_total", {"method": method, "role": role})
    return value or 0.0


async def test_a_disallowed_role_is_refused_naming_the_method_and_its_role(decode_server) -> None:
    address, servicer = decode_server
    before = denied("/kvmesh.v1.Decode/Abort", PREFILL), denied("/kvmesh.v1.Decode/PushKV", GATEWAY)
    as_gateway, as_prefill = rpc.Channels(tls.load_credentials(GATEWAY)), rpc.Channels(tls.load_credentials(PREFILL))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as abort:
            await stub_as(as_prefill, address).Abort(decode_pb2.AbortRequest(request_id="r1"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            [b async for b in stub_as(as_prefill, address).Stream(decode_pb2.StreamRequest(request_id="r1"))]
        with pytest.raises(grpc.aio.AioRpcError) as pushed:
            await push(stub_as(as_gateway, address))  # only prefill may push KV to decode
    finally:
        await as_gateway.close()
        await as_prefill.close()
    assert [e.value.code() for e in (abort, stream, pushed)] == [grpc.StatusCode.PERMISSION_DENIED] * 3
    assert abort.value.details() == "/kvmesh.v1.Decode/Abort: a prefill may not call it (allowed: gateway)"
    assert stream.value.details() == "/kvmesh.v1.Decode/Stream: a prefill may not call it (allowed: gateway)"
    assert pushed.value.details() == "/kvmesh.v1.Decode/PushKV: a gateway may not call it (allowed: prefill)"
    assert servicer.calls == []  # no handler ran
    after = denied("/kvmesh.v1.Decode/Abort", PREFILL), denied("/kvmesh.v1.Decode/PushKV", GATEWAY)
    assert (after[0] - before[0], after[1] - before[1]) == (1.0, 1.0)


async def unary_code(channel: grpc.aio.Channel) -> grpc.StatusCode:
    """The status of one Abort call (a failed handshake never reaches the server: UNAVAILABLE)."""
    try:
        await decode_pb2_grpc.DecodeStub(channel).Abort(decode_pb2.AbortRequest(request_id="x"), timeout=3)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def other_ca_credentials(tmp_path: Path, role: str) -> tls.MeshCredentials:
    CertificateAuthority.create("another CA").write(tmp_path, tls.PeerIdentity(role, f"{role}-impostor"))
    credentials = tls.load_credentials(role, TLSSettings(tls_dir=str(tmp_path)))
    assert credentials is not None
    return credentials


async def test_clients_without_a_certificate_of_the_mesh_cannot_connect(decode_server, tmp_path: Path) -> None:
    address, servicer = decode_server
    mesh = tls.load_credentials(GATEWAY)
    assert mesh is not None
    options = [("grpc.ssl_target_name_override", tls.SERVER_NAME)]
    no_certificate = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(mesh.ca_pem), options=options)
    plaintext = grpc.aio.insecure_channel(address)
    impostor = rpc.Channels(other_ca_credentials(tmp_path, GATEWAY))
    try:
        codes = [await unary_code(no_certificate), await unary_code(plaintext), await unary_code(impostor.get(address))]
    finally:
        await no_certificate.close()
        await plaintext.close()
        await impostor.close()
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 3
    assert servicer.calls == []


async def test_a_client_refuses_a_server_of_another_ca(tmp_path: Path) -> None:
    impostor = other_ca_credentials(tmp_path, DECODE)
    servicer = RecordingDecode()
    server = rpc.create_server(impostor)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = rpc.bind(server, "127.0.0.1", 0, impostor)
    await server.start()
    as_gateway = rpc.Channels(tls.load_credentials(GATEWAY))
    try:
        code = await unary_code(as_gateway.get(f"127.0.0.1:{port}"))
    finally:
        await as_gateway.close()
        await server.stop(grace=None)
    assert code == grpc.StatusCode.UNAVAILABLE and servicer.calls == []


def test_the_table_lists_every_internal_method_and_only_known_roles() -> None:
    internal = {
        f"/{service.full_name}/{method.name}"
        for module in (balancer_pb2, decode_pb2, encoder_pb2, expert_lb_pb2, health_pb2, kvcache_pb2, prefill_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert set(ALLOWED_CALLERS) == internal
    assert set().union(*ALLOWED_CALLERS.values()) <= set(ROLES)
    public = {f"/{s.full_name}/{m.name}" for s in gateway_pb2.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert public == {"/kvmesh.v1.Gateway/Generate", "/kvmesh.v1.Gateway/ListModels"} and not public & internal
    # the rules, spelled out
    assert ALLOWED_CALLERS["/kvmesh.v1.Decode/PushKV"] == {PREFILL}
    assert ALLOWED_CALLERS["/kvmesh.v1.KVCache/Put"] == {PREFILL, KVCACHE}
    assert all(
        ALLOWED_CALLERS[m] == {GATEWAY}
        for m in ("/kvmesh.v1.Prefill/Prefill", "/kvmesh.v1.Decode/Stream", "/kvmesh.v1.Decode/Abort")
    )
