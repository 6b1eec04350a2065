"""deepseek-v4-tiny through every API on the session mesh: prefill computes the prompt and hands the request's whole
V4 state (windows, compressor tails and entries, indexer keys) to decode, which goes on from it. A completion's
tokens are exactly one engine's run offline; chat (plain and streamed), Responses and Anthropic Messages say the
same greedy text for the same conversation; a prompt sent again resumes from prefill's cached V4 blocks and says
the same tokens."""

from __future__ import annotations

import json

import pytest

from engine_core import LLM, SamplingParams, model_store

from .api_harness import DEEPSEEK_V4, ApiMesh

pytestmark = pytest.mark.asyncio(loop_scope="session")

NUM_TOKENS = 12
ASK = "Tell me about the sea."
MESSAGES = [{"role": "user", "content": ASK}]


@pytest.fixture
def mesh(api_mesh_session: ApiMesh) -> ApiMesh:
    return api_mesh_session


async def test_a_completion_after_the_handoff_is_exactly_one_engine_run(mesh: ApiMesh) -> None:
    """The prompt crosses the sliding window (32) and closes CSA (4) and HCA (16) windows before the handoff;
    the 12 tokens after it close more."""
    prompt = "The sea is wide and deep, and the waves roll on. " * 5
    completion = await mesh.openai().completions.create(
        model=DEEPSEEK_V4, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage is not None and completion.usage.prompt_tokens > 48
    assert completion.usage.completion_tokens == NUM_TOKENS
    offline = LLM(str(model_store.ensure(DEEPSEEK_V4)), device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    assert completion.choices[0].text == offline.generate(prompt, params)[0].text


async def test_every_api_says_the_same_greedy_text(mesh: ApiMesh) -> None:
    """Without ignore_eos (Responses and Messages do not take it): greedy, this conversation never says EOS in 12
    tokens, so every API runs them all."""
    client = mesh.openai()
    greedy = {"temperature": 0}
    chat = await client.chat.completions.create(model=DEEPSEEK_V4, messages=MESSAGES, max_tokens=NUM_TOKENS, **greedy)  # type: ignore[call-overload]
    text = chat.choices[0].message.content
    assert text and chat.usage is not None and chat.usage.completion_tokens == NUM_TOKENS
    stream = await client.chat.completions.create(
        model=DEEPSEEK_V4, messages=MESSAGES, max_tokens=NUM_TOKENS, stream=True, **greedy
    )  # type: ignore[call-overload]
    assert "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]) == text
    response = await client.responses.create(model=DEEPSEEK_V4, input=ASK, max_output_tokens=NUM_TOKENS, **greedy)  # type: ignore[call-overload]
    assert response.output_text == text
    message = await mesh.anthropic().messages.create(
        model=DEEPSEEK_V4, messages=MESSAGES, max_tokens=NUM_TOKENS, extra_body=greedy
    )  # type: ignore[call-overload]
    assert message.content[0].text == text  # type: ignore[union-attr]


async def test_a_prompt_sent_again_resumes_from_its_cached_blocks_and_says_the_same_tokens(mesh: ApiMesh) -> None:
    """The second request's prefill finds every full block of the prompt but the last token's in its engine's
    prefix cache (V4 blocks: windows, entries, indexer keys, overlaps), rebuilds the state a cold run has at that
    block boundary, and computes only the rest; decode continues from the handed-off state. The prompt is this
    test's own, so the first request is cold whatever ran before."""
    engine = mesh.prefill.engines.get(DEEPSEEK_V4) if mesh.prefill.engines else None
    assert engine is not None
    block_size = engine.kv_layout.block_size
    config = json.loads((model_store.ensure(DEEPSEEK_V4) / "config.json").read_text())
    assert block_size % max(config["compress_rates"].values()) == 0  # a boundary closes every compressor's window
    prompt = "A lighthouse keeper counts the ships that pass at dusk and writes each name in a blue book. " * 6
    client = mesh.openai()
    runs = [
        await client.completions.create(
            model=DEEPSEEK_V4,
            prompt=prompt,
            max_tokens=NUM_TOKENS,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        for _ in range(2)
    ]
    cold, hit = (run.usage for run in runs)
    assert cold is not None and hit is not None and cold.prompt_tokens == hit.prompt_tokens
    num_full_blocks = (cold.prompt_tokens - 1) // block_size  # a hit leaves the last token to compute
    assert num_full_blocks >= 4  # past the sliding window (32) and several HCA windows (16)
    assert cold.prompt_tokens_details is not None and cold.prompt_tokens_details.cached_tokens == 0
    assert hit.prompt_tokens_details is not None
    assert hit.prompt_tokens_details.cached_tokens == num_full_blocks * block_size
    assert cold.completion_tokens == hit.completion_tokens == NUM_TOKENS
    tokens = [run.choices[0].logprobs.tokens for run in runs]  # type: ignore[union-attr]
    assert tokens[1] == tokens[0] and len(tokens[0]) == NUM_TOKENS
    assert runs[1].choices[0].text == runs[0].choices[0].text
