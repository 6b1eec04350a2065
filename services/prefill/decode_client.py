"""Pushing a request's KV to a decode worker: the header, then layer-major chunks, over the worker's bulk lane
(decode.proto, PushLaneFrame: each chunk's bytes written straight from where the export holds them) where it
has one, else over Decode.PushKV. The two answer alike: the bytes sent, or a PushError naming the worker."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from engine_core.kv_transfer import KVChunk, KVExport
from mesh import lane, rpc
from mesh.compute.convert import image_to_proto, layout_to_proto, sampling_to_proto
from mesh.logging import get_logger
from mesh.pb import common_pb2, decode_pb2, decode_pb2_grpc
from mesh.tracing import traceparent
from services.prefill.prefiller import PrefillJob, PushError

PUSH_TIMEOUT_S = 120.0  # the whole push; a long prompt's KV is hundreds of MB on a slow network
log = get_logger(__name__)


def header_to_proto(job: PrefillJob, export: KVExport) -> decode_pb2.KVPushHeader:
    return decode_pb2.KVPushHeader(
        request_id=job.request_id,
        model=job.model,
        prompt_token_ids=export.prompt_token_ids,
        output_token_ids=export.output_token_ids,
        sampling=sampling_to_proto(job.params),
        cache_salt=job.cache_salt or "",
        layout=layout_to_proto(export.layout),
        num_tokens=export.num_tokens,
        num_blocks=export.num_blocks,
        images=[image_to_proto(image) for image in job.images],
    )


def chunk_to_proto(chunk: KVChunk, with_data: bool = True) -> decode_pb2.KVChunk:
    return decode_pb2.KVChunk(
        layer=chunk.layer,
        first_block=chunk.first_block,
        num_blocks=chunk.num_blocks,
        data=bytes(chunk.data) if with_data else b"",
    )  # bytes: no copy


def push_error(job: PrefillJob, code: grpc.StatusCode, details: str | None) -> PushError:
    worker = job.decode_worker_id or job.decode_address
    message = f"KV push to decode worker {worker} failed: {code.name}: {details or ''}".rstrip(": ")
    return PushError(message, worker, is_exhausted=code == grpc.StatusCode.RESOURCE_EXHAUSTED)


class DecodePusher:
    def __init__(
        self,
        channels: rpc.Channels,
        timeout_s: float = PUSH_TIMEOUT_S,
        use_lanes: bool = True,
        lane_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.channels = channels
        self.timeout_s = timeout_s
        self.use_lanes = use_lanes  # push over decode workers' bulk lanes where they have one
        self.lanes = lane.LanePool(ssl_context=lane_tls)  # mutual TLS unless the mesh runs insecure

    def close(self) -> None:
        self.lanes.close()

    async def push(self, job: PrefillJob, export: KVExport, chunks: AsyncIterator[KVChunk]) -> int:
        """Returns the KV bytes sent. Raises PushError (decode full, failed, unreachable, or the push broke)."""
        address = job.decode_data_address
        if self.use_lanes and address:
            try:
                sock = await self.lanes.acquire(address)
            except (OSError, TimeoutError) as exc:  # nothing sent yet: gRPC may still reach the worker
                log.warning(
                    "decode worker's bulk lane unreachable; pushing over gRPC",
                    address=address,
                    error=str(exc) or type(exc).__name__,
                )
            else:
                async with self.lanes.holding(address, sock):
                    return await self._push_lane(sock, job, export, chunks)
        return await self._push_grpc(job, export, chunks)

    async def _push_lane(
        self, sock: socket.socket, job: PrefillJob, export: KVExport, chunks: AsyncIterator[KVChunk]
    ) -> int:
        num_bytes = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                header = decode_pb2.PushLaneFrame(header=header_to_proto(job, export), traceparent=traceparent())
                await lane.send_frame(sock, header)
                await self._answer(sock, job, "reserved")
                async for chunk in chunks:
                    if lane.has_pending(sock):  # decode gave up on the push: its end frame says why
                        await self._answer(sock, job, "end")
                    await lane.send_frame(
                        sock, decode_pb2.PushLaneFrame(chunk=chunk_to_proto(chunk, False)), [chunk.data]
                    )
                    num_bytes += len(chunk.data)
                await lane.send_frame(sock, decode_pb2.PushLaneFrame(end=common_pb2.LaneEnd()))
                await self._answer(sock, job, "response")
        except TimeoutError as exc:
            raise push_error(
                job, grpc.StatusCode.DEADLINE_EXCEEDED, f"the push took longer than {self.timeout_s:g} s"
            ) from exc
        except (lane.LaneError, OSError) as exc:
            raise push_error(job, grpc.StatusCode.UNAVAILABLE, f"the bulk lane broke: {exc}") from exc
        return num_bytes

    @staticmethod
    async def _answer(sock: socket.socket, job: PrefillJob, expected: str) -> None:
        """Read decode's next frame: `expected`, or raise the PushError an end frame names."""
        frame, payload_bytes = await lane.recv_frame(sock, decode_pb2.PushLaneFrame)
        kind = frame.WhichOneof("kind")
        if kind == "end":
            raise push_error(job, lane.status_of(frame.end), frame.end.error)
        if kind != expected or payload_bytes:
            raise lane.LaneError(f"decode answered {kind} where {expected} was due")

    async def _push_grpc(self, job: PrefillJob, export: KVExport, chunks: AsyncIterator[KVChunk]) -> int:
        stub = decode_pb2_grpc.DecodeStub(self.channels.get(job.decode_address))
        # written from this task (not a request iterator grpc would consume on its own), so no chunk is read
        # after we return: the caller releases the blocks right after
        call = stub.PushKV(timeout=self.timeout_s, metadata=rpc.metadata(job.request_id))
        num_bytes = 0
        try:
            await call.write(decode_pb2.KVPushMessage(header=header_to_proto(job, export)))
            if rpc.KV_RESERVED_KEY not in await call.initial_metadata():
                await call  # refused before reserving: raises with decode's status
            async for chunk in chunks:
                await call.write(decode_pb2.KVPushMessage(chunk=chunk_to_proto(chunk)))
                num_bytes += len(chunk.data)
            await call.done_writing()
            await call
        except grpc.aio.AioRpcError as exc:
            raise push_error(job, exc.code(), exc.details()) from exc
        except asyncio.InvalidStateError as exc:  # decode ended the call while we wrote: its status says why
            raise push_error(job, await call.code(), await call.details()) from exc
        finally:
            if not call.done():  # we failed or were cancelled: a broken stream makes decode free the blocks
                call.cancel()
        return num_bytes
