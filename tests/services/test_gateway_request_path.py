"""What the gateway does on every request's way to its first token, and does once: the prompt's block keys are
hashed in the same trip to a tokenizer thread as the prompt itself and routed as they are, and the stream's role
chunk leaves in one write with the first token's content.

Harness: the `mesh` and `script` fixtures of tests/services/gateway_harness.py (scripted workers).
"""

from __future__ import annotations

import time

import grpc
import pytest

from engine_core.kv_cache.block_hash import hash_token_blocks, root_hash
from mesh.pb import common_pb2
from services.gateway.chat import render_and_hash, render_prompt, start_all, start_chat
from services.gateway.chat_completions import ChunkShape, chat_chunks, parse_chat_request
from services.gateway.core import GatewayCore
from services.gateway.errors import GatewayError
from services.gateway.openai_shapes import sse

from . import gateway_harness
from .gateway_harness import COMPLETION, MODEL, Mesh, Script, prompt_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, script = gateway_harness.mesh, gateway_harness.script  # fixtures: each test file starts its own gateway

BLOCK_SIZE = 16  # the fake workers' announced block size
LONG = "the lighthouse keeper watched the sea and the wind " * 8  # 4 full blocks and a part


def core_of(mesh: Mesh) -> GatewayCore:
    assert mesh.gateway.core is not None
    return mesh.gateway.core


async def test_the_key_hasher_hashes_as_the_workers_do(mesh: Mesh, script: Script) -> None:
    pipeline = core_of(mesh).pipeline
    prompt = prompt_ids(mesh, LONG)
    expected = hash_token_blocks(root_hash(MODEL, "salt"), prompt, BLOCK_SIZE)
    assert len(expected) == len(prompt) // BLOCK_SIZE == 4
    assert pipeline.key_hasher(MODEL, "salt")(prompt) == expected
    assert pipeline.block_keys(MODEL, prompt, "salt") == expected
    assert pipeline.key_hasher(MODEL)(prompt) == hash_token_blocks(root_hash(MODEL), prompt, BLOCK_SIZE)


async def test_one_trip_renders_the_prompt_and_its_keys(mesh: Mesh, script: Script) -> None:
    turn = parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": LONG}]}).turn
    hasher = core_of(mesh).pipeline.key_hasher(MODEL, "s")
    prompt, keys = render_and_hash(mesh.model, turn, hasher)
    assert prompt == render_prompt(mesh.model, turn) == prompt_ids(mesh, LONG)
    assert keys == tuple(hash_token_blocks(root_hash(MODEL, "s"), prompt, BLOCK_SIZE))


async def test_every_choice_is_routed_by_the_keys_hashed_with_the_prompt(mesh: Mesh, script: Script) -> None:
    core = core_of(mesh)
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "n": 2, "max_tokens": 4}
    run = await start_chat(core, parse_chat_request(body).turn, "keys-n2")
    try:
        expected = hash_token_blocks(root_hash(MODEL), prompt_ids(mesh, LONG), BLOCK_SIZE)
        assert [list(route.block_hashes) for route in script.routes] == [expected, expected]
        assert sorted(route.request_id for route in script.routes) == ["keys-n2-0", "keys-n2-1"]  # concurrent
    finally:
        run.close()


async def test_a_generation_is_routed_by_its_own_keys_not_hashed_again(mesh: Mesh, script: Script) -> None:
    """Whatever keys the generation carries are the ones routed (they were hashed off the loop already)."""
    core = core_of(mesh)
    carried = (b"k" * 32, b"j" * 32)
    sampling = common_pb2.SamplingParams(max_tokens=4)
    generation = core.generation(
        "carried",
        mesh.model,
        prompt_ids(mesh, LONG),
        sampling,
        (),
        "",
        "chat",
        "messages",
        "max_tokens",
        block_keys=carried,
    )
    (stream,) = await start_all(core.pipeline, [generation], core.deadline())
    assert not isinstance(stream, BaseException)
    stream.close()
    assert [list(route.block_hashes) for route in script.routes] == [list(carried)]


async def test_one_generation_that_fails_comes_back_as_a_value(mesh: Mesh, script: Script) -> None:
    """As gather's return_exceptions gives it, so start_chat settles the reservation before raising."""
    core = core_of(mesh)
    script.prefill_failures = [(grpc.StatusCode.INVALID_ARGUMENT, None)]
    sampling = common_pb2.SamplingParams(max_tokens=4)
    generation = core.generation("fails", mesh.model, prompt_ids(mesh), sampling, (), "", "chat", "messages", "m")
    (failure,) = await start_all(core.pipeline, [generation], core.deadline())
    assert isinstance(failure, GatewayError) and failure.http_status == 400


async def test_the_role_chunk_leaves_with_the_first_tokens_content(mesh: Mesh, script: Script) -> None:
    script.batch_delay_s = 0.2  # decode's tokens come later: the first frame holds only what prefill gave
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 4}
    chat = parse_chat_request(body)
    run = await start_chat(core_of(mesh), chat.turn, "first-frame")
    shape = ChunkShape("chatcmpl-first-frame", int(time.time()), MODEL, include_usage=False)
    try:
        frames = chat_chunks(chat, run, shape)
        first = await anext(frames)
        first_text = mesh.model.tokenizer.decode([script.token_ids[0]])
        assert COMPLETION.startswith(first_text) and first_text
        assert first == sse(shape.role(0)) + sse(shape.content(first_text, 0))
        assert b"".join([f async for f in frames]).endswith(b"data: [DONE]\n\n")
    finally:
        run.close()
