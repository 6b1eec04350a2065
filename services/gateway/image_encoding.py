"""The gateway's side of the encoder pool: a turn's images -> embeddings -> their places in the prompt.

1. every image is read and checked (images.read_image) and sent to the encoder worker the balancer picks
   (Balancer.RouteEncoder: cache affinity by the image's hash under a load bound; the same policy here,
   `pick_encoder`, when no balancer answers), all at once; a worker that fails is excluded and the image goes to
   the next one;
2. each image's placeholder token in the rendered prompt becomes `num_tokens` of them (the encoder's output
   length), and the image becomes a PromptImage (its hash, offset and embeddings) that travels with the prompt
   to prefill, which puts the embeddings at those positions; the hash enters the block keys there and in routing.

Embeddings come back through the gateway (as in SGLang's encode/prefill/decode split, where the encoder's output
reaches prefill with the request): the gateway needs each image's length to lay out the prompt anyway, and at
these sizes (64 tokens x the model's width) the bytes are small next to the KV they produce.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence

import grpc
import grpc.aio

from engine_core.kv_cache.block_hash import KeySpan
from mesh import rpc
from mesh.discovery import KnownWorker
from mesh.logging import get_logger
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2, encoder_pb2, encoder_pb2_grpc
from mesh.routing.encoder import pick_encoder as routing_pick_encoder
from mesh.routing.state import WorkerState
from services.gateway.catalog import ServedModel
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.images import ImagePart, ImageSettings, check_count, read_image
from services.gateway.mesh_view import Registry

log = get_logger(__name__)
ENCODE_TIMEOUT_S = 30.0
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


def pick_encoder(candidates: Sequence[KnownWorker], outstanding: Mapping[str, int], image: bytes) -> KnownWorker | None:
    """The encoder worker for one image, by the balancer's encoder policy (mesh.routing.encoder): the image's
    rendezvous home (so a repeated image finds its embeddings cached) unless that worker has more than a couple of
    Encode calls outstanding over the least loaded one (this gateway's in flight plus what the worker reported)."""
    if not candidates:
        return None
    by_id = {w.worker_id: w for w in candidates}
    states = [WorkerState(w.worker_id, w.last_seen_ms / 1000, num_running=w.load.num_running) for w in candidates]
    chosen = routing_pick_encoder(
        states,
        hashlib.sha256(image).digest(),
        num_outstanding=lambda s: outstanding.get(s.worker_id, 0) + s.num_running,
    )
    return by_id[chosen]


def key_spans(images: Sequence[encoder_pb2.PromptImage]) -> list[KeySpan]:
    """The block-key spans of a prompt's images (engine_core.kv_cache.block_hash)."""
    return [KeySpan(image.offset, image.offset + image.num_tokens, image.image_hash) for image in images]


def place_images(
    model: ServedModel, token_ids: list[int], encoded: Sequence[encoder_pb2.EncodeResponse], param: str
) -> tuple[list[int], tuple[encoder_pb2.PromptImage, ...]]:
    """Each placeholder token of the rendered prompt (one per image, in order) -> num_tokens placeholders."""
    token_id = model.image_token_id
    assert token_id is not None
    positions = [i for i, t in enumerate(token_ids) if t == token_id]
    if len(positions) != len(encoded):
        token = model.tokenizer.backend.id_to_token(token_id)
        raise invalid(
            param,
            f"the prompt holds {len(positions)} image placeholder tokens for {len(encoded)} images: "
            f"the text must not contain {token!r}",
        )
    out: list[int] = []
    images = []
    previous = 0
    for position, image in zip(positions, encoded, strict=True):  # counts checked equal above
        out += token_ids[previous:position]
        images.append(
            encoder_pb2.PromptImage(
                image_hash=image.image_hash,
                offset=len(out),
                num_tokens=image.num_tokens,
                hidden_size=image.hidden_size,
                dtype=image.dtype,
                embeddings=image.embeddings,
            )
        )
        out += [token_id] * image.num_tokens
        previous = position + 1
    return out + token_ids[previous:], tuple(images)


class ImageEncoding:
    def __init__(
        self, settings: ImageSettings, registry: Registry, channels: rpc.Channels, max_retries: int = 2
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.channels = channels
        self.max_retries = max_retries
        self._outstanding: dict[str, int] = {}  # worker id -> this gateway's Encode calls in flight; only here

    async def encode_all(
        self, model: str, parts: tuple[ImagePart, ...], request_id: str
    ) -> list[encoder_pb2.EncodeResponse]:
        """Every image's embeddings, in order; GatewayError (400 naming the part) for a bad image."""
        check_count(parts, self.settings)
        tasks = [
            asyncio.ensure_future(self._read_and_encode(model, part, f"{request_id}/img{i}"))
            for i, part in enumerate(parts)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _read_and_encode(self, model: str, part: ImagePart, request_id: str) -> encoder_pb2.EncodeResponse:
        image = await read_image(part, self.settings)
        excluded: set[str] = set()
        for _ in range(self.max_retries + 1):
            worker = await self._choose(model, image, excluded, request_id)
            if worker is None:
                break
            try:
                return await self._encode(worker, model, image, request_id)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise invalid(part.param, f"bad image: {error.details()}") from None
                log.warning("encode failed", encoder=worker.worker_id, code=error.code().name, details=error.details())
                if error.code() not in RETRYABLE:
                    raise GatewayError(ErrorKind.UPSTREAM, f"the encoder worker failed ({error.code().name})") from None
                excluded.add(worker.worker_id)
        raise GatewayError(ErrorKind.UNAVAILABLE, f"no encoder worker is available for {model!r} images; retry shortly")

    async def _choose(self, model: str, image: bytes, excluded: set[str], request_id: str) -> KnownWorker | None:
        """The balancer's choice (Balancer.RouteEncoder); where no balancer answers, this gateway's own by the same
        policy, from its view of the encoder pool."""
        request = balancer_pb2.RouteEncoderRequest(
            request_id=request_id,
            model=model,
            image_hash=hashlib.sha256(image).digest(),
            exclude_worker_ids=sorted(excluded),
        )
        for balancer in self.registry.workers(common_pb2.ROLE_BALANCER):
            stub = balancer_pb2_grpc.BalancerStub(self.channels.get(balancer.info.address))
            try:
                response: balancer_pb2.RouteEncoderResponse = await stub.RouteEncoder(
                    request, timeout=rpc.ROUTE_TIMEOUT_S, metadata=rpc.metadata(request_id)
                )
            except grpc.aio.AioRpcError as error:
                log.info(
                    "encoder route failed", balancer=balancer.worker_id, code=error.code().name, details=error.details()
                )
                continue
            return KnownWorker(response.encoder, common_pb2.WorkerLoad(), 0)
        live = [w for w in self.registry.workers(common_pb2.ROLE_ENCODER, model) if w.worker_id not in excluded]
        return pick_encoder(live, self._outstanding, image)

    async def _encode(
        self, worker: KnownWorker, model: str, image: bytes, request_id: str
    ) -> encoder_pb2.EncodeResponse:
        stub = encoder_pb2_grpc.EncoderStub(self.channels.get(worker.info.address))
        self._outstanding[worker.worker_id] = self._outstanding.get(worker.worker_id, 0) + 1
        try:
            response: encoder_pb2.EncodeResponse = await stub.Encode(
                encoder_pb2.EncodeRequest(request_id=request_id, model=model, image=image),
                timeout=ENCODE_TIMEOUT_S,
                metadata=rpc.metadata(request_id),
            )
            return response
        finally:
            self._outstanding[worker.worker_id] -= 1
            if not self._outstanding[worker.worker_id]:
                del self._outstanding[worker.worker_id]
