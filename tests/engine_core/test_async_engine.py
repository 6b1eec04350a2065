import asyncio

import pytest

from engine_core import EngineConfig, LLMEngine, SamplingParams
from engine_core.async_engine import AsyncEngine, EngineFailure, WrongThreadError


@pytest.fixture
def engine(llama_reference):
    return LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=64))


async def collect(async_engine, request_id, prompt, params):
    tokens = []
    async for out in async_engine.generate(request_id, prompt, params):
        tokens += out.new_token_ids
    return tokens


async def test_concurrent_requests_match_the_sync_engine(engine, llama_reference):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 17]
    reference = LLMEngine(EngineConfig(str(llama_reference[0]), device="cpu", num_kv_blocks=64))
    for i, p in enumerate(prompts):
        reference.add_request(str(i), p, params)
    expected: dict[str, list[int]] = {}
    while reference.has_unfinished_requests():
        for out in reference.step():
            expected.setdefault(out.request_id, []).extend(out.new_token_ids)

    async_engine = AsyncEngine(engine)
    await async_engine.start()
    try:
        results = await asyncio.gather(*(collect(async_engine, str(i), p, params) for i, p in enumerate(prompts)))
        assert results == [expected[str(i)] for i in range(3)]
        assert async_engine.stats.num_generated_tokens == 18
    finally:
        await async_engine.stop()


async def test_a_listener_that_leaves_aborts_its_request(engine):
    async_engine = AsyncEngine(engine)
    await async_engine.start()
    try:
        stream = async_engine.generate("r", list(range(5, 30)), SamplingParams(max_tokens=10_000, ignore_eos=True))
        first = await stream.__anext__()
        assert first.new_token_ids
        await stream.aclose()
        for _ in range(100):
            if not await async_engine.call(lambda e: e.has_unfinished_requests()):
                break
            await asyncio.sleep(0.01)
        assert await async_engine.call(lambda e: e.stats().num_free_kv_blocks) == 64
    finally:
        await async_engine.stop()


async def test_bad_input_raises_to_the_caller_and_a_failing_step_fails_only_its_requests(engine):
    async_engine = AsyncEngine(engine)
    await async_engine.start()
    try:
        with pytest.raises(ValueError, match="empty"):
            await collect(async_engine, "bad", [], SamplingParams())
        original = engine.runner.execute
        engine.runner.execute = lambda output: (_ for _ in ()).throw(RuntimeError("device lost"))
        with pytest.raises(EngineFailure, match="device lost"):
            await collect(async_engine, "doomed", [5, 6], SamplingParams(max_tokens=3))
        engine.runner.execute = original
        assert len(await collect(async_engine, "fine", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))) == 3
    finally:
        await async_engine.stop()


async def test_only_the_engine_thread_touches_the_inner_engine(engine):
    async_engine = AsyncEngine(engine, name="engine-under-test")
    with pytest.raises(WrongThreadError, match="owned by thread 'engine-under-test'"):
        async_engine.engine  # noqa: B018 -- the access itself is what must raise
    await async_engine.start()
    try:
        with pytest.raises(WrongThreadError):  # the event loop's thread
            async_engine.engine  # noqa: B018 -- the access itself is what must raise
        with pytest.raises(WrongThreadError):  # any other thread
            await asyncio.to_thread(lambda: async_engine.engine)
        # on the engine thread it is the engine itself: the one `call` passes
        assert await async_engine.call(lambda e: async_engine.engine is e is engine)
        # what the event loop may read instead: facts fixed at load, the same as the engine's
        assert async_engine.kv_layout == engine.kv_layout and async_engine.max_model_len == engine.max_model_len
        assert async_engine.prompt_block_hashes(list(range(40))) == engine.prompt_block_hashes(list(range(40)))
    finally:
        await async_engine.stop()
