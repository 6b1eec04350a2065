"""Prefill's KV push over decode's bulk lane (decode.proto, PushLaneFrame), with real prefill and decode services on
loopback and a real NATS: the same tokens as one engine, the connection reused, the codes PushKV would give for
bad pushes, blocks freed when the pusher goes away or stalls, and PushKV when the lane cannot be reached."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
import torch

from engine_core import SamplingParams
from engine_core.kv_cache.manager import cdiv
from kvmesh.nats_server import free_port
from mesh import lane, rpc, tls
from mesh.access import GATEWAY
from mesh.compute.convert import layout_to_proto, sampling_to_proto
from mesh.config import SettingError, load_settings
from mesh.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.decode.config import DecodeSettings
from services.decode.lane import PushLane
from services.decode.server import DecodeService
from services.prefill.config import PrefillSettings
from services.prefill.server import PrefillService

from . import pd_harness
from .pd_harness import reference_outputs, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

nats_url = pd_harness.nats_url  # fixture: this file starts its own NATS

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LLAMA_BLOCK_BYTES = 3 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block * kv heads * head size * fp32
LAYER_BLOCK_BYTES = LLAMA_BLOCK_BYTES // 3  # one layer's slice of one block: a chunk's unit


def as_prefill() -> ssl.SSLContext | None:
    """The TLS context prefill dials decode's lane with (the suite's certificates, tests/conftest.py)."""
    return lane.client_tls(tls.load_credentials("prefill"))


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 490, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Pair:
    prefill: PrefillService
    decode: DecodeService
    prefill_stub: prefill_pb2_grpc.PrefillStub
    decode_stub: decode_pb2_grpc.DecodeStub
    model: str

    def request(self, request_id: str, prompt: list[int], **fields: object) -> prefill_pb2.PrefillRequest:
        values: dict = dict(
            request_id=request_id,
            model=self.model,
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(GREEDY),
            decode_address=self.decode.runtime.address,
            decode_worker_id=self.decode.runtime.worker_id,
            decode_data_address=self.decode.runtime.data_address,
        )
        return prefill_pb2.PrefillRequest(**{**values, **fields})

    def num_free_blocks(self) -> int:
        return self.decode.engines.stats()[self.model].num_free_kv_blocks

    async def wait_for_free_blocks(self) -> None:
        total = self.decode.engines.stats()[self.model].num_kv_blocks
        await wait_until(lambda: self.num_free_blocks() == total, what="decode's blocks to be free")

    def header(self, request_id: str, num_tokens: int, **fields: object) -> decode_pb2.KVPushHeader:
        values: dict = dict(
            request_id=request_id,
            model=self.model,
            prompt_token_ids=prompt_of(num_tokens, seed=num_tokens),
            output_token_ids=[7],
            sampling=sampling_to_proto(GREEDY),
            layout=layout_to_proto(self.decode.engines.layout(self.model)),
            num_tokens=num_tokens,
            num_blocks=cdiv(num_tokens, 16),
        )
        return decode_pb2.KVPushHeader(**{**values, **fields})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(nats_url, llama_reference) -> AsyncIterator[Pair]:
    model = str(llama_reference[0])
    common = dict(
        nats_url=nats_url,
        heartbeat_interval_s=0.2,
        log_level="warning",
        drain_timeout_s=5.0,
        models=(model,),
        kv_cache_memory_bytes=16 * LLAMA_BLOCK_BYTES,
    )
    decode = await DecodeService.start(load_settings(DecodeSettings, env={}, worker_id="decode-lane", **common))
    prefill = await PrefillService.start(
        load_settings(
            PrefillSettings,
            env={},
            worker_id="prefill-lane",
            kvcache_enabled=False,
            **{**common, "kv_cache_memory_bytes": 64 * LLAMA_BLOCK_BYTES},
        )
    )  # room for what decode refuses
    channels = rpc.Channels(tls.load_credentials(GATEWAY))
    assert decode.runtime.data_address and decode.runtime.data_address != decode.runtime.address
    yield Pair(
        prefill,
        decode,
        prefill_pb2_grpc.PrefillStub(channels.get(prefill.runtime.address)),
        decode_pb2_grpc.DecodeStub(channels.get(decode.runtime.address)),
        model,
    )
    await channels.close()
    for service in (prefill, decode):
        await service.stop()


async def follow(pair: Pair, request_id: str) -> list[int]:
    return [
        t async for b in pair.decode_stub.Stream(decode_pb2.StreamRequest(request_id=request_id)) for t in b.token_ids
    ]


async def test_a_push_over_the_lane_gives_exactly_the_tokens_of_one_engine_and_reuses_the_connection(pair: Pair):
    address = pair.decode.runtime.data_address
    assert pair.prefill.pusher is not None
    for i, length in enumerate((37, 50)):
        prompt = prompt_of(length, seed=i)
        expected, _ = reference_outputs(pair.model, prompt, GREEDY)
        response = await pair.prefill_stub.Prefill(pair.request(f"lane-{i}", prompt))
        assert response.kv_bytes_sent == cdiv(length, 16) * LLAMA_BLOCK_BYTES
        assert [response.first_token_id] + await follow(pair, f"lane-{i}") == expected
        assert pair.prefill.pusher.lanes.num_idle(address) == 1  # the one connection, back in the pool each time
    await pair.wait_for_free_blocks()


async def test_an_unreachable_lane_falls_back_to_pushkv(pair: Pair):
    prompt = prompt_of(40, seed=5)
    expected, _ = reference_outputs(pair.model, prompt, GREEDY)
    response = await pair.prefill_stub.Prefill(
        pair.request("fallback", prompt, decode_data_address=f"127.0.0.1:{free_port()}")
    )
    assert [response.first_token_id] + await follow(pair, "fallback") == expected
    await pair.wait_for_free_blocks()


async def exchange(address: str, frames: list[tuple[decode_pb2.PushLaneFrame, bytes]]) -> decode_pb2.PushLaneFrame:
    """Send the frames on a new connection, then read decode's answers up to the one that ends the push; after an
    error decode must close the connection."""
    sock = await lane.connect(address, 2.0, as_prefill())
    try:
        for frame, payload in frames:
            await lane.send_frame(sock, frame, [payload])
        while True:
            answer, _ = await lane.recv_frame(sock, decode_pb2.PushLaneFrame)
            if answer.WhichOneof("kind") != "reserved":
                break
        if answer.WhichOneof("kind") == "end":
            with pytest.raises(lane.LaneError, match="closed"):
                await lane.recv_frame(sock, decode_pb2.PushLaneFrame)
        return answer
    finally:
        sock.close()


def chunk(layer: int, num_blocks: int, num_bytes: int) -> tuple[decode_pb2.PushLaneFrame, bytes]:
    return decode_pb2.PushLaneFrame(chunk=decode_pb2.KVChunk(layer=layer, num_blocks=num_blocks)), bytes(num_bytes)


async def test_bad_pushes_on_the_lane_get_the_codes_pushkv_gives_and_free_their_blocks(pair: Pair):
    header = (decode_pb2.PushLaneFrame(header=pair.header("bad", 20)), b"")
    end = (decode_pb2.PushLaneFrame(end=common_pb2.LaneEnd()), b"")
    cases = [
        ([chunk(0, 2, 2 * LAYER_BLOCK_BYTES)], grpc.StatusCode.INVALID_ARGUMENT, "must start with its header"),
        (
            [(decode_pb2.PushLaneFrame(header=pair.header("bad", 20, model="nope")), b"")],
            grpc.StatusCode.NOT_FOUND,
            "model 'nope'",
        ),
        (
            [header, chunk(0, 2, 2 * LAYER_BLOCK_BYTES + 1)],
            grpc.StatusCode.INVALID_ARGUMENT,
            f"KV chunk of {2 * LAYER_BLOCK_BYTES + 1} bytes does not hold 2 blocks",
        ),
        ([header, chunk(0, 3, 3 * LAYER_BLOCK_BYTES)], grpc.StatusCode.INVALID_ARGUMENT, "does not hold 3 blocks"),
        (
            [header, chunk(0, 2, 2 * LAYER_BLOCK_BYTES), end],
            grpc.StatusCode.INVALID_ARGUMENT,
            "incomplete KV push",
        ),  # one layer of three
        ([header, header], grpc.StatusCode.INVALID_ARGUMENT, "exactly one header"),
        (
            [header] + [chunk(layer % 3, 2, 2 * LAYER_BLOCK_BYTES) for layer in range(4)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "holds more than its header's 2 blocks per layer",
        ),
    ]
    for frames, code, message in cases:
        answer = await exchange(pair.decode.runtime.data_address, frames)
        assert (answer.WhichOneof("kind"), answer.end.code, message in answer.end.error) == (
            "end",
            code.value[0],
            True,
        ), answer
    await pair.wait_for_free_blocks()

    async with holding_blocks(pair, 100):  # 7 of the 16 blocks
        answer = await exchange(
            pair.decode.runtime.data_address, [(decode_pb2.PushLaneFrame(header=pair.header("no-room", 150)), b"")]
        )  # 10 blocks
        assert (answer.end.code, answer.end.error) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "no free KV blocks")
    await pair.wait_for_free_blocks()


@contextlib.asynccontextmanager
async def holding_blocks(pair: Pair, num_tokens: int) -> AsyncIterator[None]:
    """A push that reserved its blocks and sends nothing more until the block exits."""
    sock = await lane.connect(pair.decode.runtime.data_address, 2.0, as_prefill())
    try:
        await lane.send_frame(sock, decode_pb2.PushLaneFrame(header=pair.header(f"holds-{num_tokens}", num_tokens)))
        assert (await lane.recv_frame(sock, decode_pb2.PushLaneFrame))[0].WhichOneof("kind") == "reserved"
        yield
    finally:
        sock.close()


async def test_a_whole_push_by_hand_is_answered_with_its_bytes(pair: Pair):
    frames = [(decode_pb2.PushLaneFrame(header=pair.header("by-hand", 20)), b"")]
    frames += [chunk(layer, 2, 2 * LAYER_BLOCK_BYTES) for layer in range(3)]
    frames += [(decode_pb2.PushLaneFrame(end=common_pb2.LaneEnd()), b"")]
    answer = await exchange(pair.decode.runtime.data_address, frames)
    assert (answer.response.worker_id, answer.response.num_bytes) == ("decode-lane", 2 * LLAMA_BLOCK_BYTES)
    assert len(await follow(pair, "by-hand")) == 9  # decoding from the pushed KV: 10 tokens, prefill's first
    await pair.wait_for_free_blocks()


async def test_a_pusher_that_goes_away_or_stalls_frees_the_blocks(pair: Pair):
    sock = await lane.connect(pair.decode.runtime.data_address, 2.0, as_prefill())
    await lane.send_frame(sock, decode_pb2.PushLaneFrame(header=pair.header("gone", 100)))
    answer, _ = await lane.recv_frame(sock, decode_pb2.PushLaneFrame)
    assert answer.WhichOneof("kind") == "reserved" and pair.num_free_blocks() == 16 - 7
    sock.close()  # prefill died mid-push
    await pair.wait_for_free_blocks()

    impatient = PushLane(pair.decode.decoder, pair.decode.runtime.lifecycle, "decode-impatient", push_timeout_s=1.0)
    port = await impatient.start("127.0.0.1", 0)
    try:
        sock = await lane.connect(f"127.0.0.1:{port}", timeout_s=2.0)
        await lane.send_frame(sock, decode_pb2.PushLaneFrame(header=pair.header("stalled", 100)))
        frames = [(await lane.recv_frame(sock, decode_pb2.PushLaneFrame))[0] for _ in range(2)]  # then nothing sent
        assert [f.WhichOneof("kind") for f in frames] == ["reserved", "end"]
        assert (frames[1].end.code, frames[1].end.error) == (
            grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
            "the KV push took longer than 1 s",
        )
        sock.close()
        await pair.wait_for_free_blocks()
    finally:
        await impatient.stop()


async def test_a_refused_push_fails_the_prefill_naming_the_worker(pair: Pair):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async with holding_blocks(pair, 100):
            await pair.prefill_stub.Prefill(pair.request("no-room", prompt_of(150, seed=9)))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no free KV blocks" in error.value.details()
    assert dict(error.value.trailing_metadata() or ())[rpc.FAILED_WORKER_KEY] == "decode-lane"
    await pair.wait_for_free_blocks()


async def test_the_data_port_setting_is_checked():
    with pytest.raises(SettingError, match="KVMESH_DATA_PORT=70000"):
        load_settings(DecodeSettings, env={"KVMESH_DATA_PORT": "70000"})
