"""Decode's bulk lane (mesh.lane): prefill's KV pushes over TLS (or plain TCP), the same exchange as Decode.PushKV.

A push (decode.proto, PushLaneFrame): a header frame, answered with `reserved` once the blocks are held; chunk
frames, each chunk's bytes as the frame's payload, received straight into one buffer the engine loads from
(pooled: faulting in fresh pages cost more than the wire); an end frame, answered with `response` once every
chunk is written and the request decodes. A push that fails (bad input, no free blocks, draining, too slow) gets
an end frame with the error and the code PushKV would have answered; prefill closing the connection mid-push
aborts it, and the Decoder frees its blocks either way.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import ClassVar

import grpc

from engine_core.kv_transfer import KVChunk, KVLayoutError
from mesh import metrics, tracing
from mesh.compute.convert import image_from_proto, layout_from_proto, sampling_from_proto
from mesh.compute.errors import status_on_error
from mesh.config import LaneSettings
from mesh.lane import BufferPool, LaneListener, recv_exactly_into, recv_frame, send_frame
from mesh.logging import bind_request_id
from mesh.pb import decode_pb2
from mesh.rpc import ServiceError
from mesh.service import Lifecycle
from services.decode.decoder import Decoder, PushHeader

PUSH_TIMEOUT_S = 120.0  # header to end: the deadline prefill puts on PushKV, so a stalled pusher frees its blocks
RECEIVE_BUFFER_BYTES = 512 * 2**20  # idle receive buffers kept for the next pushes
PREFILL_TO_DECODE = "prefill_to_decode"  # kvmesh_kv_transfer_bytes_total's direction, counted by both ends
PEER_ROLES = frozenset({"prefill"})  # only prefill pushes KV (over TLS)


def header_from_proto(h: decode_pb2.KVPushHeader) -> PushHeader:
    """Raises SamplingParamsError (INVALID_ARGUMENT) for parameters the engine refuses."""
    return PushHeader(
        request_id=h.request_id,
        model=h.model,
        prompt_token_ids=list(h.prompt_token_ids),
        output_token_ids=list(h.output_token_ids),
        params=sampling_from_proto(h.sampling),
        cache_salt=h.cache_salt or None,
        layout=layout_from_proto(h.layout),
        num_tokens=h.num_tokens,
        num_blocks=h.num_blocks,
        images=tuple(image_from_proto(i) for i in h.images),
    )


class PushLane(LaneListener[decode_pb2.PushLaneFrame]):
    span_names: ClassVar[Mapping[str, str]] = {"header": "kvmesh.v1.Decode/PushKV"}

    def __init__(
        self,
        decoder: Decoder,
        lifecycle: Lifecycle,
        worker_id: str,
        limits: LaneSettings | None = None,
        ssl_context: ssl.SSLContext | None = None,
        push_timeout_s: float = PUSH_TIMEOUT_S,
    ) -> None:
        super().__init__(decode_pb2.PushLaneFrame, limits, ssl_context, PEER_ROLES)
        self.decoder = decoder
        self.lifecycle = lifecycle
        self.worker_id = worker_id
        self.push_timeout_s = push_timeout_s
        self.buffers = BufferPool(RECEIVE_BUFFER_BYTES)

    async def answer(self, sock: socket.socket, frame: decode_pb2.PushLaneFrame, payload_bytes: int) -> None:
        """Take one push."""
        with self.lifecycle.track(), status_on_error():
            if frame.WhichOneof("kind") != "header" or payload_bytes:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "a KV push must start with its header")
            header = header_from_proto(frame.header)
            with bind_request_id(header.request_id):
                num_bytes = await self._receive(sock, header)
        metrics.KV_TRANSFER_BYTES.labels(direction=PREFILL_TO_DECODE).inc(num_bytes)
        tracing.current_span().set_attribute(tracing.BYTES_MOVED, num_bytes)
        response = decode_pb2.PushKVResponse(worker_id=self.worker_id, num_bytes=num_bytes)
        await send_frame(sock, decode_pb2.PushLaneFrame(response=response))

    async def _receive(self, sock: socket.socket, header: PushHeader) -> int:
        """The Decoder takes the push within its deadline; the KV bytes received."""
        taken: list[bytearray] = []
        try:
            async with asyncio.timeout(self.push_timeout_s):
                num_bytes = await self.decoder.receive(
                    header,
                    self._chunks(sock, header, taken),
                    on_reserved=lambda: send_frame(sock, decode_pb2.PushLaneFrame(reserved=decode_pb2.PushReserved())),
                )
        except TimeoutError as exc:
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the KV push took longer than {self.push_timeout_s:g} s"
            ) from exc
        self.buffers.give(taken)  # the engine has copied it; not after a failure, when it may not have
        return num_bytes

    async def _chunks(self, sock: socket.socket, header: PushHeader, taken: list[bytearray]) -> AsyncIterator[KVChunk]:
        """The push's chunks up to its end frame, received one after another into one pooled buffer (put in
        `taken`), which the Decoder keeps until it writes them all in one engine call. The buffer is taken at the
        first chunk: by then the header is checked and its blocks are reserved, so its size is one the cache
        holds."""
        layout = header.layout
        total = layout.transfer_bytes(header.num_blocks, header.num_tokens)
        buffer = memoryview(b"")
        offset = 0
        while True:
            frame, payload_bytes = await recv_frame(sock, decode_pb2.PushLaneFrame)
            kind = frame.WhichOneof("kind")
            if kind == "end" and not payload_bytes:
                return
            if kind != "chunk":
                raise ValueError("a KV push has exactly one header, and it comes first; then chunks, then an end")
            chunk = frame.chunk
            # checked before the payload is read: it lands in what the header announced, never past it
            expected = layout.transfer_chunk_bytes(chunk.layer, chunk.num_blocks, header.num_tokens)
            if not 0 < chunk.num_blocks <= header.num_blocks or payload_bytes != expected:
                raise KVLayoutError(f"KV chunk of {payload_bytes} bytes does not hold {chunk.num_blocks} blocks")
            if offset + payload_bytes > total:
                raise KVLayoutError(f"the KV push holds more than its header's {header.num_blocks} blocks per layer")
            if not taken:
                taken.append(self.buffers.take_at_least(total))
                buffer = memoryview(taken[0])
            data = buffer[offset : offset + payload_bytes]
            await recv_exactly_into(sock, data)
            offset += payload_bytes
            yield KVChunk(chunk.layer, chunk.first_block, chunk.num_blocks, data)
