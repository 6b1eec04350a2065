"""What the bound on tokens from byte counts (engine_core.token_bound) costs and proves, beside tokenizing: for
texts of ordinary words and of one repeated word at several sizes, the bound's rounds (as the gateway runs them
for a context of --context tokens, so they stop once they prove that) and the real tokenization. Prints one JSON
object on stdout.

    .venv/bin/python bench/token_bound.py [--model deepseek-tiny] [--context 16384]

Figures per text: bytes, tokens (the real count), bound (what the rounds proved), bound_ms and tokenize_ms
(median of three), refused (whether the bound alone refuses it for the context).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from engine_core import model_store  # noqa: E402
from engine_core.tokenizer import Tokenizer  # noqa: E402

WORDS = ("the", "model", "serves", "tokens", "quickly", "and", "with", "care", "12345", "kv", "cache", "\n")


def median_ms(call: Callable[[], object]) -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 1)


def texts() -> dict[str, str]:
    rng = random.Random(0)
    words = " ".join(rng.choice(WORDS) for _ in range(220_000))
    return {
        "words_100KB": words[:100_000],
        "words_1MB": words[:1_000_000],
        "describe_1MiB": "describe " * 116_508,
    }


def measure(model: str, context: int) -> dict[str, Any]:
    tokenizer = Tokenizer.from_dir(model_store.ensure(model))
    assert tokenizer is not None
    tokenizer.warm()
    bound = tokenizer._byte_count_bound
    assert bound is not None, f"{model}: no bound by byte counts for this tokenizer"
    figures: dict[str, Any] = {"model": model, "context": context}

    def tokenize(text: str) -> list[int]:
        return list(tokenizer.backend.encode_batch([text], add_special_tokens=False)[0].ids)

    for name, text in texts().items():
        num_tokens = len(tokenize(text))
        proved = bound.min_num_tokens([text], context)
        figures[name] = {
            "bytes": len(text.encode()),
            "tokens": num_tokens,
            "bound": proved,
            "refused": proved >= context,
            "bound_ms": median_ms(lambda text=text: bound.min_num_tokens([text], context)),
            "tokenize_ms": median_ms(lambda text=text: tokenize(text)),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-tiny")
    parser.add_argument("--context", type=int, default=16384)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.context)))


if __name__ == "__main__":
    main()
