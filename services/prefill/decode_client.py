"""Pushing a request's KV to a decode worker over Decode.PushKV: the header, then layer-major chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from engine_core.kv_transfer import KVChunk, KVExport
from mesh import rpc
from mesh.pb import decode_pb2, decode_pb2_grpc
from services.compute.convert import image_to_proto, layout_to_proto, sampling_to_proto
from services.prefill.prefiller import PrefillJob, PushError

PUSH_TIMEOUT_S = 120.0  # the whole push; a long prompt's KV is hundreds of MB on a slow network


def header_to_proto(job: PrefillJob, export: KVExport) -> decode_pb2.KVPushMessage:
    return decode_pb2.KVPushMessage(header=decode_pb2.KVPushHeader(
        request_id=job.request_id, model=job.model, prompt_token_ids=export.prompt_token_ids,
        output_token_ids=export.output_token_ids, sampling=sampling_to_proto(job.params),
        cache_salt=job.cache_salt or "", layout=layout_to_proto(export.layout), num_tokens=export.num_tokens,
        num_blocks=export.num_blocks, images=[image_to_proto(image) for image in job.images],
    ))


def chunk_to_proto(chunk: KVChunk) -> decode_pb2.KVPushMessage:
    return decode_pb2.KVPushMessage(chunk=decode_pb2.KVChunk(
        layer=chunk.layer, first_block=chunk.first_block, num_blocks=chunk.num_blocks, data=chunk.data))


def push_error(job: PrefillJob, code: grpc.StatusCode, details: str | None) -> PushError:
    worker = job.decode_worker_id or job.decode_address
    message = f"KV push to decode worker {worker} failed: {code.name}: {details or ''}".rstrip(": ")
    return PushError(message, worker, is_exhausted=code == grpc.StatusCode.RESOURCE_EXHAUSTED)


class DecodePusher:
    def __init__(self, channels: rpc.Channels, timeout_s: float = PUSH_TIMEOUT_S) -> None:
        self.channels = channels
        self.timeout_s = timeout_s

    async def push(self, job: PrefillJob, export: KVExport, chunks: AsyncIterator[KVChunk]) -> int:
        """Returns the KV bytes sent. Raises PushError (decode full, failed, unreachable, or the stream broke)."""
        stub = decode_pb2_grpc.DecodeStub(self.channels.get(job.decode_address))
        # written from this task (not a request iterator grpc would consume on its own), so no chunk is read
        # after we return: the caller releases the blocks right after
        call = stub.PushKV(timeout=self.timeout_s, metadata=rpc.metadata(job.request_id))
        num_bytes = 0
        try:
            await call.write(header_to_proto(job, export))
            if rpc.KV_RESERVED_KEY not in await call.initial_metadata():
                await call  # refused before reserving: raises with decode's status
            async for chunk in chunks:
                await call.write(chunk_to_proto(chunk))
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
