"""Text synthesised for traces that carry lengths and block hashes but no text.

A block of a Mooncake trace is `BLOCK_TOKENS` prompt tokens named by a hash id: equal ids mean equal blocks. Each
id becomes the same run of common English words (a seeded choice per id), one word per token for the tokenizers
of the field (each word, with its leading space, is one token in the GPT-2, Llama, SmolLM2 and DeepSeek
vocabularies), so two requests that share leading ids share a token prefix at the server, and the server's
prefix cache sees the reuse the trace recorded. The server's usage, not this approximation, gives the counts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces

WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "it",
    "at",
    "by",
    "from",
    "this",
    "be",
    "or",
    "are",
    "was",
    "an",
    "have",
    "not",
    "but",
    "they",
    "his",
    "her",
    "one",
    "all",
    "we",
    "can",
    "more",
    "time",
    "when",
    "there",
    "will",
    "about",
    "if",
    "up",
    "out",
    "them",
    "some",
    "so",
    "into",
    "him",
    "has",
    "two",
    "like",
    "other",
    "than",
    "then",
    "now",
    "only",
    "its",
    "over",
    "also",
    "new",
    "these",
    "way",
    "may",
    "well",
    "could",
    "first",
    "any",
    "see",
    "just",
    "very",
    "after",
)


def block_words(hash_id: int, num_tokens: int = BLOCK_TOKENS) -> list[str]:
    """The block named by `hash_id`: a shorter block is a prefix of the full one (a request's last block)."""
    rng = random.Random(hash_id)
    return [rng.choice(WORDS) for _ in range(BLOCK_TOKENS)][:num_tokens]


def trace_prompt(hash_ids: Sequence[int], input_length: int) -> str:
    """`input_length` tokens (about): the blocks of `hash_ids` in order, the last one cut to what is left."""
    words: list[str] = []
    for hash_id in hash_ids:
        left = input_length - len(words)
        if left <= 0:
            break
        words += block_words(hash_id, min(BLOCK_TOKENS, left))
    return " ".join(words)


def synthetic_prompt(rng: random.Random, num_tokens: int, shared_prefix: Sequence[str]) -> str:
    """`shared_prefix` (the same words for every request) and then words of this request's own."""
    own = [rng.choice(WORDS) for _ in range(max(0, num_tokens - len(shared_prefix)))]
    return " ".join([*shared_prefix[:num_tokens], *own])
