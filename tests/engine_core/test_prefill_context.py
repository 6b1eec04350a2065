"""A prompt computed in many chunks keeps its context contiguous between them (models.batch.PrefillContext):
the same logits, bit for bit, as gathering the whole context every chunk, and nothing kept once it is done."""

from __future__ import annotations

import torch

from engine_core import EngineConfig, LLMEngine, SamplingParams

# The test Llama's keys and values of one token: 3 layers x 2 (k, v) x 2 kv heads x head size 16 x 4 bytes (fp32)
BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4


def chunked_engine(path, *, keeps_context: bool, num_kv_blocks: int = 64) -> LLMEngine:
    """An engine that computes at most 16 tokens a step, in 16-token blocks."""
    config = EngineConfig(str(path), device="cpu", num_kv_blocks=num_kv_blocks, max_num_batched_tokens=16)
    engine = LLMEngine(config)
    if not keeps_context:
        engine.runner.max_prefill_context_bytes = 0  # the full gather in every layer, every chunk
    return engine


def record_logits(engine: LLMEngine) -> list[tuple[torch.Tensor, int]]:
    """Every step's logits, as the runner returns them to the sampler, with the bytes of kept contexts after it."""
    steps: list[tuple[torch.Tensor, int]] = []
    execute = engine.runner.execute

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        logits = execute(*args, **kwargs)
        steps.append((logits.clone(), engine.runner.prefill_context_bytes))
        return logits

    engine.runner.execute = recording  # type: ignore[method-assign]
    return steps


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: LLMEngine, work: list[tuple[str, list[int]]], max_tokens: int = 6) -> dict[str, list[int]]:
    """Add the requests one after another, each once the one before finished (the second of two equal prompts
    then starts after a prefix-cache hit), with a short stream decoding beside each."""
    tokens: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for request_id, ids in work:
        engine.add_request(f"{request_id}-stream", prompt(5, 99), params)
        engine.add_request(request_id, ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_kept_context_gives_the_full_gathers_logits_exactly(llama_reference):
    long = prompt(200, 1)
    work = [("a", long), ("b", prompt(90, 2)), ("c", long)]  # c: its first 192 tokens are prefix-cache hits
    gathered, kept = (
        chunked_engine(llama_reference[0], keeps_context=False),
        chunked_engine(llama_reference[0], keeps_context=True),
    )
    gathered_logits, kept_logits = record_logits(gathered), record_logits(kept)
    assert run(kept, work) == run(gathered, work)
    assert len(kept_logits) == len(gathered_logits) > 13  # 200 tokens in 16-token chunks: 13 prefill steps
    for (kept_step, _), (gathered_step, _) in zip(kept_logits, gathered_logits, strict=True):
        assert torch.equal(kept_step, gathered_step)
    assert max(num_bytes for _, num_bytes in gathered_logits) == 0
    assert max(num_bytes for _, num_bytes in kept_logits) == 208 * BYTES_PER_TOKEN  # a's (and c's) 13 blocks


def test_the_context_lives_while_the_prompt_prefills_and_no_longer(llama_reference):
    engine = chunked_engine(llama_reference[0], keeps_context=True)
    engine.add_request("a", prompt(200, 1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the first 16 tokens
    assert engine.runner.has_prefill_context("a")
    assert engine.runner.prefill_context_bytes == 208 * BYTES_PER_TOKEN == 159_744  # 13 blocks of 16 tokens
    for _ in range(11):
        engine.step()
    assert engine.runner.has_prefill_context("a")  # 192 of 200 tokens computed
    engine.step()  # the last 8: the prefill ends
    assert not engine.runner.has_prefill_context("a")
    assert engine.runner.prefill_context_bytes == 0


def test_an_aborted_prompt_drops_its_context(llama_reference):
    engine = chunked_engine(llama_reference[0], keeps_context=True)
    engine.add_request("a", prompt(200, 1), SamplingParams(max_tokens=4))
    engine.step()
    engine.step()
    assert engine.runner.prefill_context_bytes == 159_744
    assert engine.abort_request("a")
    assert not engine.runner.has_prefill_context("a")
    assert engine.runner.prefill_context_bytes == 0


def test_a_preempted_prompt_drops_its_context_and_recomputes_the_same_tokens(llama_reference):
    # 12 blocks: the prompt (11 blocks) and the stream (2 blocks once past 16 tokens) do not fit together; the
    # prompt, arrived last, is preempted when it asks for its 11th block, its context kept until then
    work = [("a", prompt(170, 3))]
    roomy = run(chunked_engine(llama_reference[0], keeps_context=True), work, max_tokens=8)
    tight = chunked_engine(llama_reference[0], keeps_context=True, num_kv_blocks=12)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tight.add_request("a-stream", prompt(14, 98), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    tight.step()
    tight.add_request("a", work[0][1], params)
    tokens: dict[str, list[int]] = {}
    num_dropped = 0  # preemptions of `a` while it kept a context
    while tight.has_unfinished_requests():
        preemptions, had_context = tight.stats().num_preemptions, tight.runner.has_prefill_context("a")
        for out in tight.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if tight.stats().num_preemptions > preemptions:
            assert not tight.runner.has_prefill_context("a")
            num_dropped += had_context
    assert num_dropped > 0
    assert tokens["a"] == roomy["a"]
    assert tight.runner.prefill_context_bytes == 0
