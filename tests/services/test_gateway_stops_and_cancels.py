"""A request that ends early frees the workers: a stop string cancels or skips decode, a prefill that finishes
the request skips decode, and a client that leaves cancels the prefill or the decode stream.

Harness: the `mesh` and `script` fixtures of tests/services/gateway_harness.py (scripted workers).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from mesh.pb import common_pb2

from . import gateway_harness
from .gateway_harness import KEY, MODEL, Mesh, Script, post, sse_events, wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, script = gateway_harness.mesh, gateway_harness.script  # fixtures: each test file starts its own gateway


async def test_stop_string_ends_the_stream_and_cancels_decode(mesh: Mesh, script: Script) -> None:
    script.batch_size = 1
    script.batch_delay_s = 0.05
    status, _, raw = await post(
        mesh,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stop": ["Bye"],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1] if c["choices"])
    assert content == "Hello world. "
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == 5  # Hello, world, ., By, e
    await wait_for(lambda: script.stream_ends)
    assert script.stream_ends == ["cancelled"]


async def test_stop_string_in_the_first_token_aborts_decode(mesh: Mesh, script: Script) -> None:
    status, _, raw = await post(
        mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stop": "Hello"}
    )
    body = json.loads(raw)
    assert status == 200 and body["choices"][0]["message"]["content"] == ""
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 1
    await wait_for(lambda: script.own_aborts())
    assert script.streams == [] and script.own_aborts() == [script.prefills[0].request_id]


async def test_prefill_finishing_the_request_skips_decode(mesh: Mesh, script: Script) -> None:
    script.token_ids = script.token_ids[:1]
    script.finish_reason = common_pb2.FINISH_REASON_STOP
    status, _, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    body = json.loads(raw)
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    await asyncio.sleep(0.05)
    assert script.streams == [] and script.own_aborts() == []


async def test_client_leaving_cancels_the_decode_stream(mesh: Mesh, script: Script) -> None:
    script.batch_size = 1
    script.batch_delay_s = 0.3
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{mesh.base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
        ) as response,
    ):
        for _ in range(3):  # role, "Hello" (prefill's token), " world" (decode's first batch)
            await response.content.readuntil(b"\n\n")
        response.close()
    await wait_for(lambda: script.stream_ends and script.own_aborts())
    assert script.stream_ends == ["cancelled"]
    assert script.own_aborts() == [script.prefills[0].request_id]  # in case the cancel raced the call's start


async def test_client_leaving_during_prefill_cancels_it(mesh: Mesh, script: Script) -> None:
    script.prefill_delay_s = 5.0
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(
                f"{mesh.base_url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
                timeout=aiohttp.ClientTimeout(total=0.5),
            )
    await wait_for(lambda: script.prefill_ends and script.own_aborts())
    assert script.prefill_ends == ["cancelled"]
    assert script.own_aborts() == [script.prefills[0].request_id]  # the KV may have reached decode already
    assert script.streams == []
