"""A request added with the output it already has (a generation migrated from a failed worker) goes on exactly
as the uninterrupted request: seeded draws (by output position), presence penalties and grammars all count the
output it was given."""

from __future__ import annotations

import json

import pytest

from engine_core import SamplingParams
from engine_core.engine import LLMEngine, PromptError

from .test_structured_output import PERSON, PERSON_GRAMMAR, chat_prompt


def run(
    engine: LLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    output_token_ids: list[int] | None = None,
) -> list[int]:
    """The request's whole output (what it was given, then what it generated)."""
    request = engine.add_request(request_id, prompt, params, output_token_ids=output_token_ids or ())
    while engine.has_unfinished_requests():
        engine.step()
    return list(request.output_token_ids)


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_resumed_sampled_request_continues_exactly(smollm2_llm, cut: int) -> None:
    engine = smollm2_llm.engine
    prompt = chat_prompt(smollm2_llm, "Tell me about the sea.")
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=12, presence_penalty=1.5, frequency_penalty=0.5, ignore_eos=True
    )
    whole = run(engine, f"whole-{cut}", prompt, params)
    assert len(whole) == 12
    assert run(engine, f"resumed-{cut}", prompt, params, whole[:cut]) == whole
    # as prompt (how migration worked before): the draws and the penalties start over, so the output differs
    tail = run(
        engine,
        f"as-prompt-{cut}",
        prompt + whole[:cut],
        SamplingParams(
            temperature=1.0, seed=7, max_tokens=12 - cut, presence_penalty=1.5, frequency_penalty=0.5, ignore_eos=True
        ),
    )
    assert whole[:cut] + tail != whole


def test_a_resumed_request_under_a_grammar_continues_exactly(smollm2_llm) -> None:
    engine = smollm2_llm.engine
    prompt = chat_prompt(smollm2_llm, "Describe a person as JSON.")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_output=PERSON_GRAMMAR)
    whole = run(engine, "json-whole", prompt, params)
    text = smollm2_llm.tokenizer.decode(whole[:-1] if whole[-1] in engine.eos_token_ids else whole)
    assert set(json.loads(text)) <= set(PERSON["properties"])
    assert run(engine, "json-resumed", prompt, params, whole[:6]) == whole  # the matcher advanced over the six


def test_output_that_cannot_be_resumed_is_refused(smollm2_llm) -> None:
    engine = smollm2_llm.engine
    prompt = chat_prompt(smollm2_llm, "Hi")
    with pytest.raises(PromptError, match="already has 4 output tokens; max_tokens is 4"):
        engine.add_request("full", prompt, SamplingParams(max_tokens=4), output_token_ids=[1, 2, 3, 4])
    with pytest.raises(PromptError, match=r"output token ids must be integers in \[0, 49152\)"):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=4), output_token_ids=[1, 10**9])
    assert not engine.has_unfinished_requests()  # neither was queued
