"""Given input embeddings (an image's, at its placeholder tokens): they change the output, chunked prefill across a
span computes exactly what one pass does, and the image's key decides which cached blocks a prompt may reuse."""

from __future__ import annotations

import pytest
import torch

from engine_core import LLM, PromptError, SamplingParams
from engine_core.engine import LLMEngine
from engine_core.kv_cache.block_hash import KeySpan, hash_token_blocks, root_hash
from engine_core.request import EmbeddingSpan

PLACEHOLDER = 7
HIDDEN = 64  # conftest.DEEPSEEK_TEST_CONFIG
IMAGE_AT, IMAGE_LEN = 20, 24  # positions [20, 44): the end of block 1, block 2, the start of block 3 (of 16)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def prompt() -> list[int]:
    tokens = torch.randint(10, 500, (56,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens[IMAGE_AT : IMAGE_AT + IMAGE_LEN] = [PLACEHOLDER] * IMAGE_LEN
    return tokens


def image(seed: int) -> EmbeddingSpan:
    embeddings = torch.randn(IMAGE_LEN, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return EmbeddingSpan(IMAGE_AT, embeddings, key=f"image-{seed}".encode())


def run(engine: LLMEngine, request_id: str, spans: tuple[EmbeddingSpan, ...]) -> tuple[list[int], list[float], int]:
    """(tokens, their logprobs, cached prompt tokens) of one greedy request."""
    engine.add_request(request_id, prompt(), PARAMS, embeddings=spans)
    tokens: list[int] = []
    logprobs: list[float] = []
    cached = -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.new_logprobs]
            cached = out.num_cached_tokens
    return tokens, logprobs, cached


@pytest.fixture(scope="module")
def engines(deepseek_reference):
    path = str(deepseek_reference[0])
    return (
        LLM(path, device="cpu", num_kv_blocks=64).engine,
        LLM(path, device="cpu", num_kv_blocks=64, max_num_batched_tokens=8).engine,
    )


def test_embeddings_replace_the_placeholder_tokens(engines):
    whole, _ = engines
    whole.kv.pool.reset_prefix_cache()
    plain = run(whole, "plain", ())
    with_image = run(whole, "image-1", (image(1),))
    other_image = run(whole, "image-2", (image(2),))
    assert with_image[1] != pytest.approx(plain[1], abs=1e-3)
    assert other_image[1] != pytest.approx(with_image[1], abs=1e-3)


def test_chunked_prefill_across_a_span_equals_one_pass(engines):
    whole, chunked = engines  # chunks of 8 tokens: the image's 24 positions are split over 4 steps
    for engine in engines:
        engine.kv.pool.reset_prefix_cache()
    one_pass, in_chunks = run(whole, "one-pass", (image(1),)), run(chunked, "chunked", (image(1),))
    assert in_chunks[0] == one_pass[0] and in_chunks[2] == one_pass[2] == 0
    assert in_chunks[1] == pytest.approx(one_pass[1], abs=2e-4)


def test_cached_blocks_are_reused_only_for_the_same_image(engines):
    whole, chunked = engines
    whole.kv.pool.reset_prefix_cache()
    first = run(whole, "first", (image(1),))
    again = run(whole, "again", (image(1),))
    assert again[2] == 48  # every full block before the last prompt token
    assert again[0] == first[0] and again[1] == pytest.approx(first[1], abs=2e-4)
    other = run(whole, "other", (image(2),))
    assert other[2] == 16  # block 0 has no image position: only it is shared
    chunked.kv.pool.reset_prefix_cache()
    fresh = run(chunked, "fresh", (image(2),))  # what image 2 gives with nothing cached
    assert other[0] == fresh[0] and other[1] == pytest.approx(fresh[1], abs=2e-4)


def test_spans_that_do_not_fit_are_refused(engines):
    whole, _ = engines
    with pytest.raises(PromptError, match=r"expected \(n, 64\)"):
        whole.add_request("wide", prompt(), PARAMS, embeddings=(EmbeddingSpan(0, torch.zeros(4, 65), b"k"),))
    with pytest.raises(PromptError, match="run past the prompt"):
        whole.add_request("past", prompt(), PARAMS, embeddings=(EmbeddingSpan(50, torch.zeros(8, 64), b"k"),))
    with pytest.raises(PromptError, match="overlap"):
        whole.add_request(
            "overlap",
            prompt(),
            PARAMS,
            embeddings=(EmbeddingSpan(0, torch.zeros(8, 64), b"a"), EmbeddingSpan(4, torch.zeros(8, 64), b"b")),
        )
    assert not whole.has_unfinished_requests()


def test_block_keys_carry_the_image_key_of_every_block_it_touches(engines):
    root, tokens = root_hash("m"), prompt()
    span_a = KeySpan(IMAGE_AT, IMAGE_AT + IMAGE_LEN, b"a")
    plain = hash_token_blocks(root, tokens, 16)
    image_a = hash_token_blocks(root, tokens, 16, key_spans=[span_a])
    image_b = hash_token_blocks(root, tokens, 16, key_spans=[span_a._replace(key=b"b")])
    assert image_a == hash_token_blocks(root, tokens, 16, key_spans=[span_a])
    assert image_a[0] == image_b[0] == plain[0]  # block 0 holds no image position
    assert len({image_a[1], image_b[1], plain[1]}) == 3  # and the chain differs from there on
    assert image_a[2] != image_b[2]
    moved = hash_token_blocks(root, tokens, 16, key_spans=[span_a._replace(start=IMAGE_AT + 1)])
    assert moved[1] != image_a[1]  # the same image at another place is another key
    whole, _ = engines  # the engine keys a request's blocks the same way, from its spans
    span = image(1)
    expected = hash_token_blocks(root_hash(whole.served_name), tokens, 16, key_spans=[span.key_span])
    assert whole.prompt_block_hashes(tokens, None, [span.key_span]) == expected
    request = whole.add_request("keys", tokens, PARAMS, embeddings=(span,))
    whole.kv.get_computed_blocks(request)
    assert request.block_hashes == expected
    whole.abort_request("keys")
    whole.step()
