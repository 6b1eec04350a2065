"""Structured output in the engine: grammars compiled for the model's vocabulary mask every sampled token,
a request's mask resumes after a handoff (decode continuing prefill's first token), compilation is cached
and bounded."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest
import torch

from engine_core import SamplingParams
from engine_core.async_engine import AsyncEngine
from engine_core.structured_output import GrammarError, StructuredOutput, grammar_mask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
PERSON_GRAMMAR = StructuredOutput("json_schema", json.dumps(PERSON))


def chat_prompt(llm, text: str) -> list[int]:
    tokenizer = llm.tokenizer
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
    )


def test_every_sampled_output_follows_the_schema(smollm2_llm) -> None:
    prompt = chat_prompt(smollm2_llm, "Describe a person as JSON.")
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_output=PERSON_GRAMMAR) for seed in range(3)
    ]
    outputs = smollm2_llm.generate([prompt] * 3, params)
    assert len({out.text for out in outputs}) > 1  # real sampling, not one forced string
    for out in outputs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)


def test_regex_and_json_object(smollm2_llm) -> None:
    prompt = chat_prompt(smollm2_llm, "A phone number?")
    regex, obj = smollm2_llm.generate(
        [prompt, prompt],
        [
            SamplingParams(
                temperature=0.9, seed=1, max_tokens=20, structured_output=StructuredOutput("regex", r"\d{3}-\d{4}")
            ),
            SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput("json_object", "")),
        ],
    )
    assert re.fullmatch(r"\d{3}-\d{4}", regex.text)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


def test_the_mask_resumes_after_a_handoff(smollm2_llm) -> None:
    """Decode builds a fresh mask for a request whose first token prefill sampled: given that token, it must
    mask exactly as prefill's own mask would have for the second token."""
    engine = smollm2_llm.engine
    compiled = engine.grammars.compile(PERSON_GRAMMAR)
    vocab = engine.model_config.vocab_size
    prefill_mask = grammar_mask(compiled, vocab)
    first = prefill_mask([])
    assert first is not None and first.shape == (vocab,)
    first_token = int(first.nonzero()[0])
    decode_mask = grammar_mask(compiled, vocab)
    after_first = prefill_mask([first_token])
    assert torch.equal(decode_mask([first_token]), after_first)
    assert not torch.equal(first, after_first)


def test_only_stop_tokens_once_the_grammar_is_done(smollm2_llm) -> None:
    engine = smollm2_llm.engine
    grammar = StructuredOutput("regex", "ab")
    mask = grammar_mask(engine.grammars.compile(grammar), engine.model_config.vocab_size)
    tokens = engine.tokenizer.encode("ab", add_special_tokens=False)
    allowed = mask(tokens)
    assert allowed is not None and set(allowed.nonzero().flatten().tolist()) == set(engine.eos_token_ids)
    assert torch.equal(mask([*tokens, engine.eos_token_ids[0], 5]), allowed)  # ignore_eos: still only EOS


def test_grammars_are_cached_and_bad_ones_refused(smollm2_llm) -> None:
    grammars = smollm2_llm.engine.grammars
    assert grammars.compile(PERSON_GRAMMAR) is grammars.compile(StructuredOutput("json_schema", json.dumps(PERSON)))
    with pytest.raises(GrammarError, match="invalid regex"):
        grammars.compile(StructuredOutput("regex", "(a"))
    with pytest.raises(GrammarError, match="invalid ebnf"):
        grammars.compile(StructuredOutput("ebnf", "root ::= nothing_defined"))
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        StructuredOutput("yaml", "a: 1")
    with pytest.raises(GrammarError, match="at most"):
        StructuredOutput("regex", "a" * 300_000)


def test_slow_compilation_is_refused_in_time(smollm2_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = smollm2_llm.engine
    monkeypatch.setattr(engine.grammars, "compile", lambda structured: time.sleep(1.0))
    params = SamplingParams(structured_output=StructuredOutput("regex", "slow"))

    async def refused_after() -> float:
        started = time.monotonic()
        with pytest.raises(GrammarError, match=re.escape("took over 0.2 s")):
            await AsyncEngine(engine).prepare_grammar(params, timeout_s=0.2)
        return time.monotonic() - started

    assert asyncio.run(refused_after()) < 0.9  # the compile runs on, but the request is refused at the deadline
