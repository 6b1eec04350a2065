"""The node's bulk lane (mesh.lane): layer-major reads and block writes over TLS (or plain TCP), the same answers as
KVCache.Get with slice_bytes and KVCache.Put, the reads written straight from the blocks the store holds.

Each connection is served by one task (mesh.lane.LaneListener), one exchange at a time. A read: a request frame,
answered by the header frames, the chunk frames (payload: the slices, never joined) and an end frame; or, for whole
blocks (slice_bytes 0), by one header frame per block with its bytes as the payload, and an end frame. A write:
block frames (payload: each block's bytes) and an end frame, answered by a put_response frame. An exchange that
fails (bad input, rejected blocks, draining) gets an end frame with the error and the gRPC code Get or Put would
have answered; what the client still sends is dropped until it closes.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from typing import ClassVar, Protocol

import grpc

from mesh import rpc
from mesh.config import LaneSettings
from mesh.lane import LaneListener, recv_bytes, recv_frame, send_frame
from mesh.pb import common_pb2, kvcache_pb2
from mesh.service import Lifecycle
from services.kvcache.blocks import Block, BlockError, layer_major_slices
from services.kvcache.codec import block_from_pb, block_to_pb

LANE_CHUNK_BYTES = 8 * 2**20  # a lane frame's payload: one scatter-gather exchange of the slices it holds
PEER_ROLES = frozenset({"prefill", "kvcache"})  # who may read and write here over TLS: prefill and the store's peers


class BlockService(Protocol):
    """What the lane answers from: the servicer's reads and writes (server.KVCacheServicer), under its lifecycle."""

    lifecycle: Lifecycle

    async def read(self, request: kvcache_pb2.GetRequest) -> list[tuple[Block, str]]:
        """The blocks Get would answer, each with the tier it came from."""
        ...

    async def write(self, blocks: list[Block], rejections: list[str]) -> kvcache_pb2.PutResponse:
        """Store the good blocks, as Put does; `rejections` name the ones that could not be parsed."""
        ...


class LaneServer(LaneListener[kvcache_pb2.LaneFrame]):
    span_names: ClassVar[Mapping[str, str]] = {"request": "kvmesh.v1.KVCache/Get", "block": "kvmesh.v1.KVCache/Put"}

    def __init__(
        self, servicer: BlockService, limits: LaneSettings | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        super().__init__(kvcache_pb2.LaneFrame, limits, ssl_context, PEER_ROLES)
        self.servicer = servicer

    async def answer(self, sock: socket.socket, frame: kvcache_pb2.LaneFrame, payload_bytes: int) -> None:
        with self.servicer.lifecycle.track(), rpc.status_on_error():
            kind = frame.WhichOneof("kind")
            if kind == "request" and not payload_bytes:
                await self._read(sock, frame.request)
                await send_frame(sock, kvcache_pb2.LaneFrame(end=common_pb2.LaneEnd()))
            elif kind == "block":
                response = await self._write(sock, frame, payload_bytes)
                await send_frame(sock, kvcache_pb2.LaneFrame(put_response=response))
            else:
                raise rpc.ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "a bulk lane exchange starts with a request frame (no payload) or a block frame",
                )

    async def _read(self, sock: socket.socket, request: kvcache_pb2.GetRequest) -> None:
        """Layer-major (slice_bytes > 0): headers, then chunks of slices; whole (0): each header with its bytes."""
        blocks = await self.servicer.read(request)
        if request.slice_bytes == 0:
            for block, tier in blocks:
                await send_frame(
                    sock, kvcache_pb2.LaneFrame(block=block_to_pb(block.without_data(), tier)), [block.data]
                )
            return
        for block, tier in blocks:
            await send_frame(sock, kvcache_pb2.LaneFrame(block=block_to_pb(block.without_data(), tier)))
        for offset, first, pieces in layer_major_slices(
            [b.data for b, _ in blocks], request.slice_bytes, LANE_CHUNK_BYTES
        ):
            chunk = kvcache_pb2.Block(offset=offset, first_block=first)
            await send_frame(sock, kvcache_pb2.LaneFrame(block=chunk), pieces)

    async def _write(
        self, sock: socket.socket, frame: kvcache_pb2.LaneFrame, payload_bytes: int
    ) -> kvcache_pb2.PutResponse:
        """Block frames (data as payloads) up to an end frame, then every good one stored, as Put does. Each block
        is buffered as its bytes arrive, and a write past `lane_max_write_bytes` is refused before its bytes are
        read; one that stalls or outlasts the exchange deadline is dropped with what it holds (LaneListener)."""
        blocks: list[Block] = []
        rejections: list[str] = []
        num_bytes = 0
        while frame.WhichOneof("kind") == "block":
            num_bytes += payload_bytes
            if payload_bytes > rpc.MAX_MESSAGE_BYTES or num_bytes > self.limits.lane_max_write_bytes:
                raise rpc.ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a block of {payload_bytes} bytes in a write of {num_bytes}: past the "
                    f"{rpc.MAX_MESSAGE_BYTES} a block and the {self.limits.lane_max_write_bytes} a write may take",
                )
            data = await recv_bytes(sock, payload_bytes)
            try:
                blocks.append(block_from_pb(frame.block, data))
            except BlockError as exc:
                rejections.append(str(exc))
            frame, payload_bytes = await recv_frame(sock, kvcache_pb2.LaneFrame)
        if frame.WhichOneof("kind") != "end" or payload_bytes:
            raise rpc.ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, "a bulk lane write is block frames, then an end frame"
            )
        return await self.servicer.write(blocks, rejections)
