"""Bad prefill requests, bad KV pushes and bad settings get the right status codes and messages, and a rejected
push frees its blocks.

Harness: the `mesh` fixture of tests/services/pd_harness.py (in-process workers).
"""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from engine_core.kv_cache.manager import cdiv
from mesh.compute.convert import layout_to_proto, sampling_to_proto
from mesh.config import SettingError, load_settings
from mesh.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.config import DecodeSettings
from services.prefill.config import PrefillSettings

from . import pd_harness
from .pd_harness import GREEDY, LLAMA_BLOCK_BYTES, Mesh, wait_for_free_blocks

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, nats_url = pd_harness.mesh, pd_harness.nats_url  # fixtures: each test file starts its own mesh


@pytest.mark.parametrize(
    "change, code, message",
    [
        (dict(model="no-such-model"), grpc.StatusCode.NOT_FOUND, "model 'no-such-model' is not served here"),
        (dict(sampling=common_pb2.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in"),
        (dict(sampling=common_pb2.SamplingParams(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(prompt_token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty"),
        (dict(prompt_token_ids=[5, 500]), grpc.StatusCode.INVALID_ARGUMENT, "prompt token ids must be integers"),
        (dict(prompt_token_ids=[-1] * 40), grpc.StatusCode.INVALID_ARGUMENT, "prompt token ids must be integers"),
        # late binding with no balancer to ask: computed, then refused before anything is pushed
        (dict(decode_address=""), grpc.StatusCode.UNAVAILABLE, "no decode worker bound for request 'bad' (no balancer"),
    ],
    ids=["unknown-model", "top-p", "max-tokens", "empty", "out-of-vocabulary", "negative", "no-decode"],
)
async def test_bad_prefill_requests_get_the_right_codes(mesh: Mesh, change, code, message):
    request = mesh.request("bad", mesh.llama, [5, 6, 7], GREEDY)
    for field, value in change.items():
        if isinstance(value, list):
            request.ClearField(field)
            getattr(request, field).extend(value)
        elif field == "sampling":
            request.sampling.CopyFrom(value)
        else:
            setattr(request, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.prefill_stub.Prefill(request)
    assert error.value.code() == code and message in error.value.details()


async def push(stub: decode_pb2_grpc.DecodeStub, *messages: decode_pb2.KVPushMessage) -> decode_pb2.PushKVResponse:
    return await stub.PushKV(iter(messages))


async def test_bad_pushes_get_the_right_codes_and_free_their_blocks(mesh: Mesh):
    layout = layout_to_proto(mesh.decode.engines.layout(mesh.llama))
    header = decode_pb2.KVPushHeader(
        request_id="pushed",
        model=mesh.llama,
        prompt_token_ids=list(range(3, 23)),
        output_token_ids=[7],
        sampling=sampling_to_proto(GREEDY),
        layout=layout,
        num_tokens=20,
        num_blocks=2,
    )
    chunk = decode_pb2.KVPushMessage(
        chunk=decode_pb2.KVChunk(layer=0, first_block=0, num_blocks=2, data=bytes(2 * LLAMA_BLOCK_BYTES // 3))
    )
    foreign = layout_to_proto(mesh.decode.engines.layout(mesh.deepseek))
    cases = [
        ((chunk,), grpc.StatusCode.INVALID_ARGUMENT, "must start with its header"),
        ((), grpc.StatusCode.INVALID_ARGUMENT, "must start with its header"),
        (
            (decode_pb2.KVPushMessage(header=decode_pb2.KVPushHeader(model="nope", layout=layout, request_id="x")),),
            grpc.StatusCode.NOT_FOUND,
            "model 'nope'",
        ),
        (
            (decode_pb2.KVPushMessage(header=_with(header, layout=foreign, num_blocks=cdiv(20, 16))),),
            grpc.StatusCode.INVALID_ARGUMENT,
            "KV layout mismatch",
        ),
        (
            (decode_pb2.KVPushMessage(header=header), chunk),
            grpc.StatusCode.INVALID_ARGUMENT,
            "incomplete KV push",
        ),  # one layer of three
        (
            (decode_pb2.KVPushMessage(header=header), decode_pb2.KVPushMessage(header=header)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exactly one header",
        ),
    ]
    for messages, code, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await push(mesh.decode_push_stub, *messages)
        assert (error.value.code(), message in error.value.details()) == (code, True), error.value.details()
    await wait_for_free_blocks(mesh.decode, mesh.llama)
    with pytest.raises(grpc.aio.AioRpcError) as error:  # a push from anyone but prefill: refused before parsing
        await push(mesh.decode_stub, *cases[0][0])
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED

    with pytest.raises(grpc.aio.AioRpcError) as error:
        await mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="never-pushed")).read()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def _with(header: decode_pb2.KVPushHeader, **fields) -> decode_pb2.KVPushHeader:
    changed = decode_pb2.KVPushHeader()
    changed.CopyFrom(header)
    for field, value in fields.items():
        if isinstance(value, common_pb2.KVLayout):
            getattr(changed, field).CopyFrom(value)
        else:
            setattr(changed, field, value)
    return changed


async def test_settings_fail_naming_the_variable():
    with pytest.raises(SettingError, match="KVMESH_TORCH_THREADS=0"):
        load_settings(PrefillSettings, env={"KVMESH_TORCH_THREADS": "0"})
    with pytest.raises(SettingError, match="KVMESH_STREAM_ATTACH_TIMEOUT_S"):
        load_settings(DecodeSettings, env={"KVMESH_STREAM_ATTACH_TIMEOUT_S": "-1"})
    settings = load_settings(DecodeSettings, env={"KVMESH_MODELS": "a, b", "KVMESH_DEVICE": "cpu"})
    assert settings.models == ("a", "b") and settings.engine_config("a").served_name == "a"
