"""A chat completion through the gateway, as the OpenAI SDK and raw HTTP see it (whole and streamed, with and
without usage), and what the gateway asks the balancer, prefill and decode for it.

Harness: the `mesh` and `script` fixtures of tests/services/gateway_harness.py (scripted workers).
"""

from __future__ import annotations

import pytest

from engine_core.kv_cache.block_hash import hash_token_blocks, root_hash
from mesh.pb import common_pb2

from . import gateway_harness
from .gateway_harness import COMPLETION, MODEL, NUM_CACHED, Mesh, Script, post, prompt_ids, sse_events, wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, script = gateway_harness.mesh, gateway_harness.script  # fixtures: each test file starts its own gateway


async def test_sdk_completion(mesh: Mesh, script: Script) -> None:
    raw = await mesh.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=50, temperature=0.5, top_p=0.9, seed=7
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == COMPLETION
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "length"
    num_prompt = len(prompt_ids(mesh))
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        num_prompt,
        len(script.token_ids),
        num_prompt + len(script.token_ids),
    )
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == NUM_CACHED
    assert raw.headers["x-kvmesh-prefill-worker"] == "prefill-a"
    assert raw.headers["x-kvmesh-decode-worker"] == "decode-a"
    request_id = raw.headers["x-request-id"]
    assert completion.id == f"chatcmpl-{request_id}"
    # what the workers were asked
    (route,) = script.routes
    assert route.request_id == request_id and route.model == MODEL
    assert route.num_prompt_tokens == num_prompt and list(route.exclude_worker_ids) == []
    assert list(route.block_hashes) == hash_token_blocks(root_hash(MODEL), prompt_ids(mesh), 16)
    (prefill,) = script.prefills
    assert list(prefill.prompt_token_ids) == prompt_ids(mesh)
    assert prefill.sampling == common_pb2.SamplingParams(
        temperature=0.5, top_p=0.9, max_tokens=50, seed=7, repetition_penalty=1.0
    )
    assert (prefill.decode_worker_id, prefill.decode_address) == ("decode-a", mesh.fakes.address)
    await wait_for(lambda: script.stream_ends)  # the fake's generator ends just after its last message is read
    assert script.streams == [request_id] and script.stream_ends == ["finished"]


async def test_sdk_stream_with_usage(mesh: Mesh, script: Script) -> None:
    script.finish_reason = common_pb2.FINISH_REASON_STOP
    stream = await mesh.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0].choices == []
    usage = usage_chunks[0].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids(mesh)), len(script.token_ids))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == COMPLETION
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


async def test_stream_without_usage_option(mesh: Mesh, script: Script) -> None:
    status, headers, raw = await post(
        mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 50}
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert headers["x-kvmesh-prefill-worker"] == "prefill-a" and headers["x-kvmesh-decode-worker"] == "decode-a"
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" not in chunk for chunk in chunks)
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == COMPLETION
