"""A property of the bulk lane's frame reader (frames and their payloads, as every lane reads them), over a real
socket pair: whatever bytes arrive (valid frames, then truncated, with bytes flipped, with header fields replaced,
or random), it yields frames that parse, the same frames when nothing was changed, and ends in the lane's own
error (LaneError), never another exception; it never waits past its stall limit when the peer goes quiet, and
never holds more than twice the bytes that came (plus the first 64 KiB buffer). And on a sealed lane, a stream with
any byte changed or cut yields only frames and payloads as they were sent, up to the change, then the lane's
error, whether its payloads are encrypted or only authenticated (and encrypted ones are not on the wire)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh import lane
from mesh.lane_io import FIRST_PIECE_BYTES, SealedSocket, stall_limit
from mesh.pb import common_pb2, kvcache_pb2

STALL_S = 0.2

blocks = st.builds(
    lambda offset, first: kvcache_pb2.LaneFrame(block=kvcache_pb2.Block(offset=offset, first_block=first)),
    st.integers(0, 2**40),
    st.integers(0, 2**20),
)
requests = st.builds(
    lambda model, keys: kvcache_pb2.LaneFrame(request=kvcache_pb2.GetRequest(model=model, block_hashes=keys)),
    st.text(max_size=20),
    st.lists(st.binary(min_size=32, max_size=32), max_size=8),
)
ends = st.builds(lambda error: kvcache_pb2.LaneFrame(end=common_pb2.LaneEnd(error=error)), st.text(max_size=30))
frames = st.lists(st.tuples(st.one_of(blocks, requests, ends), st.binary(max_size=3000)), max_size=6)


def encode(sent: list[tuple[kvcache_pb2.LaneFrame, bytes]]) -> bytes:
    out = bytearray()
    for frame, payload in sent:
        encoded = frame.SerializeToString()
        out += lane.HEADER.pack(len(encoded), len(payload)) + encoded + payload
    return bytes(out)


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[tuple[kvcache_pb2.LaneFrame, bytes]], bytes, str]:
    """(the frames, the bytes sent, what was done to them)."""
    sent = draw(frames)
    data = bytearray(encode(sent))
    how = draw(st.sampled_from(["intact", "truncated", "flipped", "header", "random"]))
    if how == "truncated" and data:
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif how == "flipped" and data:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    elif how == "header":  # the first header's fields replaced: sizes up to 4 GiB, at, under and past the limits
        size = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([lane.MAX_FRAME_BYTES, lane.MAX_PAYLOAD_BYTES]))
        data[: lane.HEADER.size] = lane.HEADER.pack(draw(size), draw(size))
    elif how == "random":
        data = bytearray(draw(st.binary(max_size=4000)))
    return sent, bytes(data), how


async def read_all(stream: bytes, close: bool) -> tuple[list[tuple[kvcache_pb2.LaneFrame, bytes]], int]:
    """Frames and payloads read until the lane's error; and the peak bytes held while reading."""
    sender, receiver = socket.socketpair()
    sender.setblocking(False)
    receiver.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sender, stream)
    if close:
        sender.close()
    got: list[tuple[kvcache_pb2.LaneFrame, bytes]] = []
    tracemalloc.start()
    try:
        with stall_limit(STALL_S):
            while True:
                try:
                    frame, payload_bytes = await lane.recv_frame(receiver, kvcache_pb2.LaneFrame)
                    got.append((frame, await lane.recv_bytes(receiver, payload_bytes)))
                except lane.LaneError:
                    break
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        receiver.close()
        sender.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.booleans())
def test_the_frame_reader_yields_valid_frames_or_the_lanes_error_within_its_limits(
    case: tuple[list[tuple[kvcache_pb2.LaneFrame, bytes]], bytes, str], close: bool
) -> None:
    sent, stream, how = case
    started = time.monotonic()
    got, peak = asyncio.run(read_all(stream, close))
    elapsed = time.monotonic() - started
    assert all(frame.IsInitialized() for frame, _ in got)
    if how == "intact":
        assert got == sent
    assert sum(len(lane.HEADER.pack(0, 0)) + f.ByteSize() + len(p) for f, p in got) <= len(stream)
    assert elapsed < (0.5 if close else STALL_S + 0.5)  # the stall limit ends a quiet peer's frame
    assert peak < 2 * len(stream) + 2 * FIRST_PIECE_BYTES + 32 * 2**10


async def sealed_stream(
    sent: list[tuple[kvcache_pb2.LaneFrame, bytes]], keys: tuple[bytes, bytes], encrypt: bool
) -> bytes:
    """The bytes a sealed lane puts on the wire for `sent`."""
    near, far = socket.socketpair()
    sealed = SealedSocket(near, keys[0], keys[1], encrypt)
    far.setblocking(False)
    for frame, payload in sent:
        await lane.send_frame(sealed, frame, [payload])
    sealed.close()
    wire = bytearray()
    loop = asyncio.get_running_loop()
    while chunk := await loop.sock_recv(far, 2**16):
        wire += chunk
    far.close()
    return bytes(wire)


async def read_sealed(
    wire: bytes, keys: tuple[bytes, bytes], encrypt: bool
) -> list[tuple[kvcache_pb2.LaneFrame, bytes]]:
    near, far = socket.socketpair()
    far.setblocking(False)
    await asyncio.get_running_loop().sock_sendall(far, wire)
    far.close()
    sealed = SealedSocket(near, keys[1], keys[0], encrypt)
    got: list[tuple[kvcache_pb2.LaneFrame, bytes]] = []
    try:
        with stall_limit(STALL_S):
            while True:
                try:
                    frame, payload_bytes = await lane.recv_frame(sealed, kvcache_pb2.LaneFrame)
                    got.append((frame, await lane.recv_bytes(sealed, payload_bytes)))
                except lane.LaneError:
                    return got
    finally:
        sealed.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames.filter(bool), st.booleans(), st.data())
def test_a_sealed_lane_yields_only_what_was_sent_and_stops_at_the_first_changed_byte(
    sent: list[tuple[kvcache_pb2.LaneFrame, bytes]], encrypt: bool, data: st.DataObject
) -> None:
    keys = (os.urandom(16), os.urandom(16))
    wire = bytearray(asyncio.run(sealed_stream(sent, keys, encrypt)))
    assert asyncio.run(read_sealed(bytes(wire), keys, encrypt)) == sent
    for _, payload in sent:  # encrypted: no payload readable on the wire; authenticated only: each as it was
        assert len(payload) < 32 or (payload in wire) != encrypt
    at = data.draw(st.integers(0, len(wire) - 1))
    if data.draw(st.booleans()):
        wire[at] ^= data.draw(st.integers(1, 255))
    else:
        del wire[at:]
    got = asyncio.run(read_sealed(bytes(wire), keys, encrypt))
    assert len(got) < len(sent) and got == sent[: len(got)]  # never a changed frame or payload
