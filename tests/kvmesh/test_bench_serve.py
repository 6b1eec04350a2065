"""`kvmesh bench serve`'s client against a real HTTP server on loopback that streams what a gateway streams: the
timings come from the content chunks, and a stream that ends with an error frame is an error naming it (it
raised KeyError 'choices' before)."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from kvmesh.bench.serve import one_request
from kvmesh.nats_server import free_port

pytestmark = pytest.mark.asyncio


def frame(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def chunk(content: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


async def serve(frames: list[bytes]) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "server-timing": "prefill;dur=12"})
        await response.prepare(request)
        for data in frames:
            await response.write(data)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_a_whole_stream_gives_its_tokens_and_timings() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    runner, url = await serve(
        [frame(chunk("a")), frame(chunk("b")), frame(chunk("c")), frame(usage), b"data: [DONE]\n\n"]
    )
    try:
        async with aiohttp.ClientSession() as session:
            sample = await one_request(session, url, "key", "m", "hi", 3)
    finally:
        await runner.cleanup()
    assert sample.num_tokens == 3
    assert sample.prefill_s == 0.012
    assert len(sample.gaps_s) == 2 and sample.ttft_s > 0


async def test_an_error_frame_is_an_error_that_names_it() -> None:
    error = {"error": {"message": "no decode worker serves model 'm'", "type": "service_unavailable"}}
    runner, url = await serve([frame(chunk("a")), frame(error), b"data: [DONE]\n\n"])
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(RuntimeError, match="no decode worker serves model 'm'"):
                await one_request(session, url, "key", "m", "hi", 3)
    finally:
        await runner.cleanup()
