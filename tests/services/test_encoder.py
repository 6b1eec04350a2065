"""The encoder role as its own process (`kvmesh serve encoder`): it answers Encode over gRPC, serves a repeated image
from its cache, refuses bad images with the problem named, and encodes only for models that take images."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from PIL import Image

from engine_core.vision import embeddings_from_bytes
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import tls
from mesh.access import GATEWAY
from mesh.pb import encoder_pb2, encoder_pb2_grpc
from services.encoder.encoder import EmbeddingCache

DEEPSEEK = "deepseek-tiny"


def png(color: tuple[int, int, int], size: tuple[int, int] = (48, 32)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def encoder() -> Iterator[encoder_pb2_grpc.EncoderStub]:
    port = free_port()
    with EmbeddedNats() as nats:
        env = {
            **os.environ,
            "KVMESH_NATS_URL": nats.url,
            "KVMESH_GRPC_PORT": str(port),
            "KVMESH_HTTP_PORT": "0",
            "KVMESH_MODELS": f"smollm2-135m,{DEEPSEEK}",
            "KVMESH_LOG_LEVEL": "warning",
            "KVMESH_MAX_IMAGE_SIDE": "1024",
            "KVMESH_WORKER_ID": "encoder-t",
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "kvmesh", "serve", "encoder"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            credentials = tls.load_credentials(GATEWAY)
            assert credentials is not None
            secure = grpc.ssl_channel_credentials(credentials.ca_pem, credentials.key_pem, credentials.cert_pem)
            options = [("grpc.ssl_target_name_override", tls.SERVER_NAME)]
            with grpc.secure_channel(f"127.0.0.1:{port}", secure, options=options) as channel:
                grpc.channel_ready_future(channel).result(timeout=60)
                yield encoder_pb2_grpc.EncoderStub(channel)
        finally:
            process.terminate()
            output, _ = process.communicate(timeout=30)
            assert process.returncode == 0, output


def encode(stub: encoder_pb2_grpc.EncoderStub, image: bytes, model: str = DEEPSEEK) -> encoder_pb2.EncodeResponse:
    response: encoder_pb2.EncodeResponse = stub.Encode(
        encoder_pb2.EncodeRequest(request_id="t", model=model, image=image), timeout=30
    )
    return response


def test_encode_then_the_same_image_from_the_cache(encoder):
    red = png((220, 20, 20))
    started = time.monotonic()
    first = encode(encoder, red)
    first_s = time.monotonic() - started
    assert (first.num_tokens, first.hidden_size, first.dtype, first.cached) == (64, 256, "float32", False)
    assert len(first.image_hash) == 32 and len(first.embeddings) == 64 * 256 * 4
    started = time.monotonic()
    again = encode(encoder, red)
    print(f"encode: {first_s * 1000:.1f} ms, from the cache: {(time.monotonic() - started) * 1000:.1f} ms")
    assert again.cached and again.image_hash == first.image_hash and again.embeddings == first.embeddings
    other = encode(encoder, png((20, 20, 220)))
    assert not other.cached and other.image_hash != first.image_hash
    assert not torch.equal(
        embeddings_from_bytes(other.embeddings, "float32", 64, 256),
        embeddings_from_bytes(first.embeddings, "float32", 64, 256),
    )


def test_bad_images_and_models_without_images_are_refused(encoder):
    with pytest.raises(grpc.RpcError) as corrupt:
        encode(encoder, b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    assert corrupt.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PNG" in corrupt.value.details()
    with pytest.raises(grpc.RpcError) as huge:
        encode(encoder, png((0, 0, 0), (1500, 8)))
    assert huge.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1500x8 pixels" in huge.value.details()
    with pytest.raises(grpc.RpcError) as text_only:
        encode(encoder, png((1, 2, 3)), model="smollm2-135m")
    assert text_only.value.code() == grpc.StatusCode.NOT_FOUND and "deepseek-tiny" in text_only.value.details()


def test_the_cache_evicts_the_least_recently_used_by_bytes():
    cache = EmbeddingCache(capacity_bytes=3 * 64)  # three (4, 4) float32 tensors
    tensors = {name: torch.full((4, 4), float(i)) for i, name in enumerate("abcd")}
    for name in "abc":
        cache.put(("m", name.encode()), tensors[name])
    assert cache.get(("m", b"a")) is not None  # a is now the most recent: b goes first
    cache.put(("m", b"d"), tensors["d"])
    assert cache.get(("m", b"b")) is None and cache.get(("m", b"a")) is not None
    cache.put(("m", b"big"), torch.zeros(8, 8))  # larger than the whole cache: not kept, nothing evicted
    stats = cache.stats()
    assert (stats.num_entries, stats.num_bytes, stats.num_hits, stats.num_misses) == (3, 192, 2, 1)
