"""The Encoder servicer and `serve()`: protobuf <-> the ImageEncoder, status codes in one place, load and metrics.

The worker announces the models it encodes for (those with a vision_config) and its in-flight Encode calls as
its load (`num_running`), which the gateway's encoder choice reads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import NoReturn

import grpc
import grpc.aio
import torch

from engine_core.vision import embeddings_to_bytes
from mesh import metrics, rpc
from mesh.logging import bind_request_id, get_logger
from mesh.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from mesh.rpc import UnknownModelError
from mesh.service import Lifecycle, ServiceRuntime
from services.encoder.config import EncoderSettings
from services.encoder.encoder import EncodedImage, ImageEncoder, load_encoders

log = get_logger(__name__)


def encoded_to_proto(encoded: EncodedImage) -> encoder_pb2.EncodeResponse:
    data, dtype = embeddings_to_bytes(encoded.embeddings)
    num_tokens, hidden_size = encoded.embeddings.shape
    return encoder_pb2.EncodeResponse(
        image_hash=encoded.image_hash,
        num_tokens=num_tokens,
        hidden_size=hidden_size,
        dtype=dtype,
        embeddings=data,
        cached=encoded.is_cached,
    )


@contextlib.contextmanager
def status_codes() -> Iterator[None]:
    """The one place this service chooses status codes: a bad image (ImageError, a ValueError) is
    INVALID_ARGUMENT with its message; a model it does not encode for is NOT_FOUND."""
    try:
        with rpc.status_on_error():
            yield
    except UnknownModelError as exc:
        raise rpc.ServiceError(grpc.StatusCode.NOT_FOUND, str(exc)) from exc


def export_metrics(model: str, encoder: ImageEncoder, encoded: EncodedImage) -> None:
    metrics.ENCODER_IMAGES.labels(model=model, cached=str(encoded.is_cached).lower()).inc()
    if not encoded.is_cached:
        metrics.ENCODER_SECONDS.labels(model=model).observe(encoded.seconds)
    metrics.ENCODER_CACHE_BYTES.set(encoder.cache.stats().num_bytes)


async def abort(context: grpc.aio.ServicerContext, error: rpc.ServiceError) -> NoReturn:
    await rpc.abort_with(context, error)
    raise AssertionError("unreachable: abort raises") from error


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, encoder: ImageEncoder, lifecycle: Lifecycle) -> None:
        self.encoder = encoder
        self.lifecycle = lifecycle

    async def Encode(
        self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncodeResponse:
        try:
            with bind_request_id(request.request_id), self.lifecycle.track(), status_codes():
                encoded = await self.encoder.encode(request.model, request.image)
                export_metrics(request.model, self.encoder, encoded)
                return encoded_to_proto(encoded)
        except rpc.ServiceError as error:
            await abort(context, error)


async def serve(settings: EncoderSettings) -> None:
    runtime = ServiceRuntime(settings, common_pb2.ROLE_ENCODER)
    torch.set_num_threads(settings.torch_threads)
    encoders = await asyncio.to_thread(
        load_encoders, settings.models, settings.encoder_weights, settings.encoder_seed, settings.device
    )
    encoder = ImageEncoder(encoders, settings.image_limits, settings.encoder_cache_bytes, settings.embedding_dtype)
    servicer = EncoderServicer(encoder, runtime.lifecycle)
    await runtime.start(
        register=lambda server: encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server),
        load=lambda: common_pb2.WorkerLoad(num_running=runtime.lifecycle.in_flight),
        models=encoder.models,
    )
    try:
        await runtime.wait_for_stop()
    finally:
        await runtime.shutdown()
        encoder.close()
