"""`kvmesh bench quant`: the int8 path (KVMESH_QUANTIZATION=int8) against our own float32 path, in one process.

Quality, on the same weights:
- greedy agreement: each prompt of a fixed set generates `num_greedy_tokens` greedy tokens with both; reported are
  the share of prompts whose outputs are identical and the mean share of tokens before the first difference;
- teacher-forced on a shipped text (tests/data/tinyshakespeare, Shakespeare, public domain): perplexity under
  each, and the share of positions whose top-1 next token is the same.
Speed: one seeded workload of `concurrency` requests (prompts and output lengths as `kvmesh bench engine`), all
submitted at once to each engine, `repeats` runs interleaved between the two so load bursts hit both alike;
medians of end-to-end tokens/s and of the decode rate (timed from the moment every request holds its first token).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine_core import LLM, SamplingParams
from engine_core.quantization import int8_kernel, prefill_logits
from kvmesh.bench.engine import PROMPT_TEXT, EngineBenchConfig, Workload, make_workload

TEXT_PATH = Path(__file__).resolve().parents[3] / "tests" / "data" / "tinyshakespeare" / "input_first120.txt"
MAX_TEXT_TOKENS = 1024
GREEDY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\n",
    "The theory of relativity says that",
    "Q: What is 12 plus 30?\nA:",
    "Dear hiring manager,",
    "The best way to learn a language is",
    "In 1969, the first humans",
    "SELECT name FROM users WHERE",
    "Photosynthesis is the process by which",
    "My favourite recipe for bread uses",
    "The stock market fell today because",
    "Water boils at",
)
BLOCK_SIZE = 16


def run_quant_bench(
    model: str, concurrency: int, repeats: int, seed: int, num_greedy_tokens: int = 32
) -> dict[str, Any]:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    workload_config = EngineBenchConfig((concurrency,), (32, 256), (16, 64), repeats, max_repeated_sequential=1)
    num_blocks = concurrency * -(-(256 + 64) // BLOCK_SIZE)
    engines = {
        mode: LLM(
            model,
            quantization=mode,
            enable_prefix_caching=False,
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_blocks,
            max_num_seqs=max(64, concurrency),
        )
        for mode in ("none", "int8")
    }
    fp32, int8 = engines["none"], engines["int8"]
    tokenizer = fp32.tokenizer
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer: the quality measures need text")
    text_ids = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)[:MAX_TEXT_TOKENS]
    source_ids = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    vocab_size = fp32.engine.model_config.vocab_size
    workload = make_workload(
        concurrency, workload_config, source_ids, vocab_size, random.Random(f"{seed}:{concurrency}")
    )
    greedy = _progress("greedy", _greedy_agreement(fp32, int8, num_greedy_tokens))
    text = _progress("text", _text_quality(fp32, int8, text_ids))
    speed = _progress("speed", _speed(engines, workload, repeats))
    return {
        "model": model,
        "torch_threads": torch.get_num_threads(),
        "quantized_engine": torch.backends.quantized.engine,
        "int8_kernel": int8_kernel(),
        "greedy": greedy,
        "text": {"path": str(TEXT_PATH.relative_to(TEXT_PATH.parents[3])), **text},
        "speed": speed,
        "int8_vs_fp32_throughput": round(speed["int8"]["throughput_tok_s"] / speed["none"]["throughput_tok_s"], 3),
        "goal": "int8_vs_fp32_throughput >= 1.8 at 32 concurrent",
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _progress(part: str, result: dict[str, Any]) -> dict[str, Any]:
    """Each part on stderr as it ends (stdout carries only the final JSON): a long run killed early keeps them."""
    print(json.dumps({part: result}), file=sys.stderr, flush=True)
    return result


def _greedy_agreement(fp32: LLM, int8: LLM, num_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    ours = [o.token_ids for o in fp32.generate(list(GREEDY_PROMPTS), params)]
    theirs = [o.token_ids for o in int8.generate(list(GREEDY_PROMPTS), params)]
    first_diffs = [_first_difference(a, b) for a, b in zip(ours, theirs, strict=True)]
    return {
        "num_prompts": len(GREEDY_PROMPTS),
        "num_tokens": num_tokens,
        "identical_share": round(sum(d == num_tokens for d in first_diffs) / len(first_diffs), 3),
        "mean_share_before_first_difference": round(statistics.mean(d / num_tokens for d in first_diffs), 3),
        "first_difference_at": first_diffs,
    }


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _text_quality(fp32: LLM, int8: LLM, ids: list[int]) -> dict[str, Any]:
    targets = torch.tensor(ids[1:])
    logprobs = {}
    for name, llm in (("fp32", fp32), ("int8", int8)):
        engine = llm.engine
        logits = prefill_logits(engine.runner.model, ids, engine.model_config.num_layers)  # (T, V)
        logprobs[name] = logits[:-1].log_softmax(-1)  # (T - 1, V): position t predicts token t + 1
    perplexity = {
        name: round(math.exp(-float(lp.gather(1, targets[:, None]).mean())), 3) for name, lp in logprobs.items()
    }
    same_top1 = (logprobs["fp32"].argmax(-1) == logprobs["int8"].argmax(-1)).float().mean()
    return {
        "num_tokens": len(ids),
        "perplexity": perplexity,
        "perplexity_change": round(perplexity["int8"] / perplexity["fp32"] - 1, 4),
        "top1_agreement": round(float(same_top1), 4),
    }


def _speed(engines: dict[str, LLM], workload: Workload, repeats: int) -> dict[str, dict[str, Any]]:
    for llm in engines.values():  # warm-up: allocator growth, kernel selection
        _serve(llm, Workload(workload.prompts[:2], [2, 2]))
    runs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in engines}
    for _ in range(repeats):
        for mode, llm in engines.items():
            runs[mode].append(_serve(llm, workload))
    return {
        mode: {
            "throughput_tok_s": round(workload.num_output_tokens / statistics.median(s for s, _ in values), 2),
            "decode_tok_s": round(statistics.median(rate for _, rate in values), 2),
            "seconds": [round(s, 3) for s, _ in values],
        }
        for mode, values in runs.items()
    }


def _serve(llm: LLM, workload: Workload) -> tuple[float, float]:
    """(wall seconds, decode tokens/s) of the whole workload submitted at once."""
    engine = llm.engine
    base = f"q{time.monotonic_ns()}"
    generated: dict[str, int] = {}
    start = time.perf_counter()
    for i, (prompt, length) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        engine.add_request(f"{base}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True))
        generated[f"{base}-{i}"] = 0
    all_started_at, tokens_then = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated[output.request_id] += len(output.new_token_ids)
        if all_started_at is None and all(generated.values()):
            all_started_at, tokens_then = time.perf_counter(), sum(generated.values())
    end = time.perf_counter()
    assert all_started_at is not None
    decode_tokens = workload.num_output_tokens - tokens_then
    return end - start, decode_tokens / max(end - all_started_at, 1e-9)
