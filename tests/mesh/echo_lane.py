"""A lane for the lane tests: each exchange is one block frame, answered with the same frame and the payload it
carried (read with `recv_bytes`, so memory follows the bytes as on the store's writes)."""

from __future__ import annotations

import socket
import ssl

from mesh import lane
from mesh.config import LaneSettings
from mesh.pb import kvcache_pb2


class EchoLane(lane.LaneListener[kvcache_pb2.LaneFrame]):
    def __init__(self, limits: LaneSettings | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(kvcache_pb2.LaneFrame, limits, ssl_context, peer_roles=frozenset({"prefill"}))

    async def answer(self, sock: socket.socket, frame: kvcache_pb2.LaneFrame, payload_bytes: int) -> None:
        data = await lane.recv_bytes(sock, payload_bytes)
        await lane.send_frame(sock, kvcache_pb2.LaneFrame(block=frame.block), [data])


async def echo(sock: socket.socket, data: bytes, offset: int = 0) -> bytes:
    """One exchange with an EchoLane: what came back."""
    await lane.send_frame(sock, kvcache_pb2.LaneFrame(block=kvcache_pb2.Block(offset=offset)), [data])
    frame, payload_bytes = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
    assert frame.block.offset == offset
    return await lane.recv_bytes(sock, payload_bytes)
