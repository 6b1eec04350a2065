"""Images in chat messages, end to end through the `openai` SDK: a real mesh in this process (NATS, a balancer, an
encoder, prefill and decode running deepseek-tiny, the gateway). The same image with the same text reuses the KV of
the first request, a different image does not, and every bad image is a 400 naming the content part."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import random
import tempfile
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import openai
import pytest
import pytest_asyncio
from aiohttp import web
from PIL import Image

from engine_core.images import ImageLimits
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh.config import load_settings
from services.balancer.config import BalancerSettings
from services.balancer.server import serve as serve_balancer
from services.decode.config import DecodeSettings
from services.decode.server import DecodeService
from services.encoder.config import EncoderSettings
from services.encoder.server import serve as serve_encoder
from services.gateway.config import GatewaySettings
from services.gateway.egress import EgressGuard
from services.gateway.errors import GatewayError
from services.gateway.images import ImagePart, ImageSettings, read_image
from services.gateway.server import GatewayServer
from services.prefill.config import PrefillSettings
from services.prefill.server import PrefillService

from .harness import serving

pytestmark = pytest.mark.asyncio(loop_scope="module")
KEY = "sk-images-test"
DEEPSEEK, SMOL = "deepseek-tiny", "smollm2-135m"
SYSTEM = (
    "You are a careful assistant who looks at pictures and describes the colours, the shapes and the mood of "
    "each one in a single short sentence."
)


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def ask(*urls: str, text: str = "What is in this picture?") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


class ImageMesh(NamedTuple):
    client: openai.AsyncOpenAI
    grpc_address: str  # the gateway's gRPC API


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh() -> AsyncIterator[ImageMesh]:
    with EmbeddedNats() as nats, tempfile.TemporaryDirectory() as state_dir:
        common = dict(nats_url=nats.url, heartbeat_interval_s=0.5, log_level="warning", drain_timeout_s=1.0)
        workers = dict(common, models=(DEEPSEEK,), kv_cache_memory_bytes=16 * 2**20)
        balancer = load_settings(BalancerSettings, env={}, grpc_port=free_port(), worker_id="balancer-i", **common)
        encoder = load_settings(
            EncoderSettings, env={}, grpc_port=free_port(), worker_id="encoder-i", models=(DEEPSEEK,), **common
        )
        async with serving(serve_balancer, balancer), serving(serve_encoder, encoder):
            decode = await DecodeService.start(load_settings(DecodeSettings, env={}, worker_id="decode-i", **workers))
            prefill = await PrefillService.start(
                load_settings(PrefillSettings, env={}, worker_id="prefill-i", kvcache_enabled=False, **workers)
            )
            gateway = GatewayServer(
                GatewaySettings(
                    nats_url=nats.url,
                    http_port=0,
                    grpc_port=0,
                    api_keys=(KEY,),
                    state_dir=state_dir,  # the tenancy database and server secret, not the home directory
                    models=(DEEPSEEK, SMOL),
                    heartbeat_interval_s=0.5,
                    log_level="warning",
                    max_image_side=512,
                )
            )
            await gateway.start()
            openai_client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key=KEY, max_retries=0, timeout=120
            )
            try:
                for _ in range(200):  # until the balancer and the gateway have heard every worker
                    try:
                        await openai_client.chat.completions.create(
                            model=DEEPSEEK, messages=ask(data_url(png((1, 1, 1)))), max_tokens=1
                        )
                        break
                    except openai.InternalServerError:
                        await asyncio.sleep(0.1)
                yield ImageMesh(openai_client, f"127.0.0.1:{gateway.grpc_port}")
            finally:
                await gateway.stop()
                await prefill.stop()
                await decode.stop()


@pytest.fixture
def client(mesh: ImageMesh) -> openai.AsyncOpenAI:
    return mesh.client


async def chat(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], model: str = DEEPSEEK) -> Any:
    return await client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]


async def test_same_image_reuses_the_kv_and_a_different_image_does_not(client):
    red = ask(data_url(png((220, 30, 30))))
    first = await chat(client, red)
    assert first.choices[0].finish_reason in ("stop", "length")
    text_only = await chat(
        client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is in this picture?"}]
    )
    # the 64 image tokens (the "\n" joining the parts merges with "?" into one token)
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 64
    again = await chat(client, red)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16
    assert again.choices[0].message.content == first.choices[0].message.content
    blue = await chat(client, ask(data_url(png((30, 30, 220)))))
    cached_blue = blue.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached_blue < again.usage.prompt_tokens_details.cached_tokens  # the text before the image only
    jpeg = io.BytesIO()
    Image.new("RGB", (40, 40), (10, 200, 10)).save(jpeg, "JPEG")
    assert (
        await chat(client, ask(data_url(jpeg.getvalue(), "image/jpeg")))
    ).usage.prompt_tokens == first.usage.prompt_tokens


async def bad_request(
    client: openai.AsyncOpenAI, messages: list[dict[str, Any]], model: str = DEEPSEEK
) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat(client, messages, model)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    return body


async def test_bad_images_are_refused_naming_the_content_part(client):
    corrupt = await bad_request(client, ask(data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)))
    assert corrupt["param"] == "messages[1].content[1]" and "PNG or JPEG" in corrupt["message"]
    noise = io.BytesIO()
    Image.frombytes("RGB", (32, 32), random.Random(0).randbytes(32 * 32 * 3)).save(noise, "PNG")
    cut = await bad_request(client, ask(data_url(noise.getvalue()[: len(noise.getvalue()) // 2])))
    assert cut["param"] == "messages[1].content[1]" and "truncated" in cut["message"]  # found by the encoder
    huge = await bad_request(client, ask(data_url(png((0, 0, 0), (600, 8)))))
    assert huge["param"] == "messages[1].content[1]" and "600x8 pixels" in huge["message"]
    urls = [data_url(png((i, i, i))) for i in range(5)]
    many = await bad_request(client, ask(*urls))
    assert many["param"] == "messages[1].content[5]" and "at most 4" in many["message"]
    remote = await bad_request(client, ask("https://example.com/cat.png"))
    assert remote["param"] == "messages[1].content[1]" and "remote image URLs are not allowed" in remote["message"]
    not_base64 = await bad_request(client, ask("data:image/png;base64,@@@"))
    assert "base64" in not_base64["message"]
    text_only = await bad_request(client, ask(data_url(png((5, 5, 5)))), model=SMOL)
    assert text_only["message"] == f"the model {SMOL!r} does not accept images"
    # the placeholder token's text in a message is plain text (engine_core.tokenizer): one image, one placeholder
    in_text = await chat(client, ask(data_url(png((6, 6, 6))), text="see <｜image｜> here"))
    assert in_text.choices[0].finish_reason in ("stop", "length")
    assistant = await bad_request(
        client,
        [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(png((7, 7, 7)))}}]}],
    )
    assert assistant["param"] == "messages[0].content[0]"
    ok = await chat(client, [{"role": "user", "content": "Still there?"}])  # other requests are unaffected
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_remote_images_are_fetched_when_allowed():
    image = png((9, 90, 200))

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/big.png":
            return web.Response(body=image * 20, content_type="image/png")
        if request.path == "/cat.png":
            return web.Response(body=image, content_type="image/png")
        return web.Response(status=404)

    runner = web.AppRunner(web.Application())
    runner.app.router.add_get("/{name}", handler)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    settings = ImageSettings(
        ImageLimits(max_bytes=4 * len(image)),
        max_images=4,
        allow_remote=True,
        fetch_timeout_s=5.0,
        egress=EgressGuard(allow_private=True),  # the server is on loopback (the guard's own tests refuse it)
    )
    try:
        base = f"http://127.0.0.1:{port}"
        assert await read_image(ImagePart("messages[0].content[0]", f"{base}/cat.png"), settings) == image
        for name, message in (("big.png", "over the limit of"), ("gone.png", "image_url could not be fetched")):
            with pytest.raises(GatewayError, match=message) as caught:
                await read_image(ImagePart("messages[0].content[1]", f"{base}/{name}"), settings)
            assert caught.value.param == "messages[0].content[1]"
    finally:
        await runner.cleanup()


async def test_the_gateway_sends_an_image_to_its_home_encoder_unless_that_one_is_busy() -> None:
    from mesh.discovery import KnownWorker
    from mesh.pb import common_pb2
    from mesh.routing.encoder import rendezvous_rank
    from services.gateway.image_encoding import pick_encoder

    workers = [
        KnownWorker(common_pb2.WorkerInfo(worker_id=f"encoder-{i}"), common_pb2.WorkerLoad(), 0) for i in range(3)
    ]
    image = b"\x89PNG pretend"
    home = max(workers, key=lambda w: rendezvous_rank(hashlib.sha256(image).digest(), w.worker_id))
    assert pick_encoder(workers, {}, image) is home
    assert pick_encoder(workers, {}, image) is home  # the same image again: where its embeddings are cached
    busy = {home.worker_id: 3}  # more than 2 calls over the idle ones: the least loaded (then by id) instead
    assert pick_encoder(workers, busy, image) is min((w for w in workers if w is not home), key=lambda w: w.worker_id)
    assert pick_encoder([], {}, image) is None


async def test_images_through_the_anthropic_sdk_match_chat_completions(client):
    """Messages' image blocks (base64 sources) reach the same prompt as Chat Completions' image_url parts; a bad
    block is a 400 in Anthropic's shape naming the block."""
    import anthropic

    messages = anthropic.AsyncAnthropic(
        base_url=str(client.base_url).removesuffix("/v1/"), api_key=KEY, max_retries=0, timeout=120
    ).messages
    image = png((120, 60, 200))
    chat_reply = await chat(client, ask(data_url(image)))
    content: list[dict[str, Any]] = [
        {"type": "text", "text": "What is in this picture?"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()},
        },
    ]
    reply = await messages.create(
        model=DEEPSEEK,
        system=SYSTEM,
        max_tokens=4,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": content}],
    )  # type: ignore[list-item]
    prompt_tokens = reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    assert prompt_tokens == chat_reply.usage.prompt_tokens
    assert reply.usage.cache_read_input_tokens == (prompt_tokens - 1) // 16 * 16  # the KV chat left, image and all
    assert reply.content[0].text == chat_reply.choices[0].message.content  # type: ignore[union-attr]

    async def refused(blocks: list[dict[str, Any]], role: str = "user") -> dict[str, Any]:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await messages.create(model=DEEPSEEK, max_tokens=4, messages=[{"role": role, "content": blocks}])  # type: ignore[misc, list-item]
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        return body["error"]

    corrupt = await refused(
        [
            {
                "type": "image",
                "source": {
                    "type": "base64",
                    "media_type": "image/png",
                    "data": base64.b64encode(b"\x89PNG\r\n\x1a\n").decode(),
                },
            }
        ]
    )
    assert corrupt == {
        "type": "invalid_request_error",
        "message": "messages[0].content[0]: bad image: the image is not a PNG or JPEG file (or its header is corrupt)",
    }
    no_source = await refused([{"type": "image", "source": {"type": "file", "file_id": "file_1"}}])
    assert "'messages[0].content[0].source' must be" in no_source["message"]
    remote = await refused([{"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}])
    assert "remote image URLs are not allowed" in remote["message"]
    from_assistant = await refused([{"type": "image", "source": content[1]["source"]}], role="assistant")
    assert "'messages[0].content[0]' must be a text block, an image or tool_result block" in from_assistant["message"]


async def test_images_through_the_grpc_api_match_chat_completions(mesh: ImageMesh):
    """ChatMessage.parts with image bytes reach the same prompt as the REST image_url part; a bad image is
    INVALID_ARGUMENT naming the part."""
    import grpc

    from mesh.pb import common_pb2, gateway_pb2, gateway_pb2_grpc

    image = png((200, 200, 20))
    chat_reply = await chat(mesh.client, ask(data_url(image)))
    metadata = (("authorization", f"Bearer {KEY}"),)

    def request(*parts: gateway_pb2.ContentPart) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(
            model=DEEPSEEK,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4),
            messages=[
                gateway_pb2.ChatMessage(role="system", content=SYSTEM),
                gateway_pb2.ChatMessage(role="user", parts=parts),
            ],
        )

    question = gateway_pb2.ContentPart(text="What is in this picture?")
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        replies = [
            r
            async for r in stub.Generate(
                request(question, gateway_pb2.ContentPart(image=gateway_pb2.ImageData(data=image))), metadata=metadata
            )
        ]
        assert replies[-1].usage.prompt_tokens == chat_reply.usage.prompt_tokens
        assert "".join(r.text for r in replies) == chat_reply.choices[0].message.content
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(
                request(question, gateway_pb2.ContentPart(image=gateway_pb2.ImageData(data=b"\x89PNG\r\n\x1a\n"))),
                metadata=metadata,
            ).read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == (
            "messages[1].parts[1]: bad image: the image is not a PNG or JPEG file (or its header is corrupt)"
        )


async def test_images_in_the_responses_api_carry_over_to_a_follow_up(client):
    """input_image parts reach the same prompt as Chat Completions; a follow-up by previous_response_id keeps the
    stored conversation's image (the same image key, so its KV is reused) and adds its own."""
    image = png((20, 160, 90))
    chat_reply = await chat(client, ask(data_url(image)))
    question = [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": data_url(image)},
    ]
    first = await client.responses.create(
        model=DEEPSEEK,
        instructions=SYSTEM,
        max_output_tokens=4,
        temperature=0,
        input=[{"role": "user", "content": question}],
    )  # type: ignore[list-item, misc]
    assert first.usage is not None and first.usage.input_tokens == chat_reply.usage.prompt_tokens
    assert first.output_text == chat_reply.choices[0].message.content
    follow_up = await client.responses.create(
        model=DEEPSEEK,
        instructions=SYSTEM,
        max_output_tokens=4,
        temperature=0,
        previous_response_id=first.id,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "And this one?"},  # type: ignore[list-item]
                    {"type": "input_image", "image_url": data_url(png((1, 2, 3)))},
                ],
            }
        ],
    )
    assert follow_up.usage is not None
    # the first turn's prompt (image and all) is a prefix of this one: its full blocks come from the cache
    assert follow_up.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens - 1) // 16 * 16
    assert follow_up.usage.input_tokens > first.usage.input_tokens + 64  # the second image's 64 tokens and more
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(
            model=DEEPSEEK,
            max_output_tokens=4,
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}],
                }
            ],
        )  # type: ignore[list-item]
    assert caught.value.body["param"] == "input[0].content[0]"  # type: ignore[index]
