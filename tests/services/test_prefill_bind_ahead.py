"""Late binding's moment (services/prefill/prefiller.py): a prompt the engine's next step computes whole is bound as
that step starts, the balancer call in a task of its own beside the compute; a prompt that takes more steps, or
waits behind another, is bound in the request's own task once its first token is sampled; a request whose first
token surely ends it is not bound at all. A real engine (a small random Llama) computes every prompt; the binder
is the prefiller's interface (`DecodeBinder`), recording the task each call ran in. Whether the next step computes
a prompt whole is asked of an engine that is never stepped, so what is ahead of a request is exact."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine_core import EngineConfig, LLMEngine, SamplingParams
from engine_core.async_engine import AsyncEngine
from engine_core.kv_transfer import KVChunk, KVExport
from mesh.compute.engines import ModelEngines
from services.prefill.prefiller import DecodeTarget, Prefiller, PrefillJob, _is_next_step

MODEL = "llama-test"
STEP_TOKENS = 64  # max_num_batched_tokens: a longer prompt takes more than one step


class RecordingBinder:
    """Binds every request to one decode worker; notes which task each call ran in."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task[object] | None] = {}

    async def bind(self, job: PrefillJob, num_kv_tokens: int) -> DecodeTarget:
        self.tasks[job.request_id] = asyncio.current_task()
        await asyncio.sleep(0)
        return DecodeTarget("decode-0", "127.0.0.1:1", "")


class CountingPusher:
    """Takes the KV (every chunk read) as a decode worker would; notes where it went."""

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}

    async def push(self, job: PrefillJob, export: KVExport, chunks: AsyncIterator[KVChunk]) -> int:
        num_bytes = 0
        async for chunk in chunks:
            num_bytes += len(chunk.data)
        self.addresses[job.request_id] = job.decode_address
        return num_bytes


def engine_config(model_dir: object) -> EngineConfig:
    return EngineConfig(
        str(model_dir), device="cpu", num_kv_blocks=64, served_name=MODEL, max_num_batched_tokens=STEP_TOKENS
    )


@pytest.fixture
async def prefill(llama_reference) -> AsyncIterator[tuple[Prefiller, RecordingBinder, CountingPusher]]:
    engine = AsyncEngine(LLMEngine(engine_config(llama_reference[0])), None, name="engine-test")
    await engine.start()
    binder, pusher = RecordingBinder(), CountingPusher()
    try:
        yield Prefiller(ModelEngines({MODEL: engine}), pusher, binder=binder), binder, pusher
    finally:
        await engine.stop()


def job(request_id: str, num_tokens: int, max_tokens: int = 8) -> PrefillJob:
    prompt = [(7 * i + len(request_id)) % 400 + 50 for i in range(num_tokens)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return PrefillJob(request_id, MODEL, prompt, params, None, decode_address="", decode_worker_id="")


async def test_a_prompt_computed_in_the_next_step_is_bound_beside_it(prefill) -> None:
    prefiller, binder, pusher = prefill
    result = await prefiller.prefill(job("short", STEP_TOKENS - 1))
    assert result.decode == DecodeTarget("decode-0", "127.0.0.1:1", "")
    assert pusher.addresses == {"short": "127.0.0.1:1"} and result.kv_bytes_sent > 0
    call_task = binder.tasks["short"]
    assert call_task is not None and call_task is not asyncio.current_task()  # its own task, started at admission


async def test_a_prompt_longer_than_a_step_is_bound_after_its_first_token(prefill) -> None:
    prefiller, binder, pusher = prefill
    request = asyncio.ensure_future(prefiller.prefill(job("long", STEP_TOKENS + 1)))
    result = await request
    assert result.decode == DecodeTarget("decode-0", "127.0.0.1:1", "")
    assert pusher.addresses == {"long": "127.0.0.1:1"}
    assert binder.tasks["long"] is request  # in the request's own task, once the first token was known


def test_the_next_step_computes_a_prompt_whole_only_when_nothing_is_ahead_and_it_fits(llama_reference) -> None:
    engine = LLMEngine(engine_config(llama_reference[0]))  # no thread: admitted here, never stepped
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine.add_request("first", job("first", STEP_TOKENS).prompt_token_ids, params)
    assert _is_next_step(engine, STEP_TOKENS)  # alone, and exactly one step's tokens
    engine.add_request("second", job("second", 8).prompt_token_ids, params)
    assert not _is_next_step(engine, 8)  # `first` is ahead of it
    engine.abort_request("first")
    engine.abort_request("second")
    engine.add_request("long", job("long", STEP_TOKENS + 1).prompt_token_ids, params)
    assert not _is_next_step(engine, STEP_TOKENS + 1)  # two steps


async def test_a_first_token_that_ends_the_request_binds_nothing(prefill) -> None:
    prefiller, binder, pusher = prefill
    result = await prefiller.prefill(job("one", 8, max_tokens=1))
    assert result.finish_reason == "length" and result.decode is None
    assert binder.tasks == {} and pusher.addresses == {}
