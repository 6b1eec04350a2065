"""`kvmesh bench sampler`: what sampling costs per decode step, for each kind of settings, against the step itself.

The logits are real: one engine (the model named, default smollm2-135m) decodes `batch` requests whose prompts
are slices of the engine bench's English paragraph, and a recording sampler keeps the logits and requests of its
last decode step. The model step's own time is measured on the same steps (the median decode step, sampling
excluded). Then the engine's `Sampler` runs on those logits under each setting below, `repeats` times each,
interleaved so that load elsewhere on the machine hits every setting alike; the median is reported with its
share of the median model step (the goal: under 5% for every setting). Each is timed twice: wall clock (the
goal's measure) and this process's CPU time, steadier where other jobs share the cores.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from engine_core import LLM, SamplingParams
from engine_core.request import Request
from engine_core.sampler import Sampler, SamplerOutput
from kvmesh.bench.engine import PROMPT_TEXT, SAMPLING

GOAL_FRACTION = 0.05
TYPICAL = SAMPLING["typical"]  # `bench engine --sampling typical`

# Each setting applies to every row, except "mixed", which cycles through the others row by row.
MIXED = "rows cycle through the other settings"
SETTINGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "top_p": SamplingParams(temperature=0.8, top_p=0.95),
    "min_p": SamplingParams(temperature=0.8, min_p=0.05),
    "typical": TYPICAL,
    "typical_seeded": replace(TYPICAL, seed=1),
    "penalties": SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
}


class _RecordingSampler:
    """Stands in for the engine's sampler: samples as it would and keeps the last batch it saw."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.logits: torch.Tensor | None = None
        self.requests: list[Request] = []

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        self.logits, self.requests = logits.clone(), list(requests)
        return self.sampler(logits, requests)


Timing = tuple[float, float]  # (wall seconds, process CPU seconds)


def capture_decode_batch(
    llm: LLM, batch: int, prompt_tokens: int, decode_steps: int
) -> tuple[torch.Tensor, list[Request], list[Timing]]:
    """(logits (batch, V), their requests, each decode step's model time): `batch` requests that each hold
    their first token decode `decode_steps` steps together; the last step's logits are kept."""
    engine = llm.engine
    tokenizer = llm.tokenizer
    source = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False) if tokenizer is not None else list(range(3, 500))
    request_ids = [f"bench-sampler-{i}" for i in range(batch)]
    for i, request_id in enumerate(request_ids):
        prompt = [source[(i * 7 + j) % len(source)] for j in range(prompt_tokens)]
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # the prompts' prefill, in as many chunks as the token budget needs
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    recorder = _RecordingSampler(engine.sampler)
    engine.sampler = recorder  # type: ignore[assignment]  # the bench's own engine; restored below
    try:
        step_seconds = [_model_seconds(engine) for _ in range(decode_steps)]
    finally:
        engine.sampler = recorder.sampler
        for request_id in request_ids:
            engine.abort_request(request_id)
    assert recorder.logits is not None and len(recorder.requests) == batch
    return recorder.logits, recorder.requests, step_seconds


def _model_seconds(engine: Any) -> Timing:
    """One engine step's time without its sampling (the sampler's time is what this bench measures apart)."""
    sampler = engine.sampler
    sampled = [0.0, 0.0]

    def timed(logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        start, cpu_start = time.perf_counter(), time.process_time()
        out = sampler(logits, requests)
        sampled[0] += time.perf_counter() - start
        sampled[1] += time.process_time() - cpu_start
        return out

    engine.sampler = timed
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.step()
        return time.perf_counter() - start - sampled[0], time.process_time() - cpu_start - sampled[1]
    finally:
        engine.sampler = sampler


def requests_with(requests: Sequence[Request], setting: str) -> list[Request]:
    """Copies of the captured requests (same tokens) under one setting's sampling parameters."""
    cycle = [p for name, p in SETTINGS.items() if name != "mixed"]
    return [
        replace(r, sampling_params=cycle[i % len(cycle)] if setting == "mixed" else SETTINGS[setting])
        for i, r in enumerate(requests)
    ]


def time_settings(
    logits: torch.Tensor, requests: Sequence[Request], settings: Sequence[str], repeats: int
) -> dict[str, list[Timing]]:
    """Time of each sampler call, per setting, interleaved round by round after one warm-up call each."""
    sampler = Sampler(seed=0)
    batches = {name: requests_with(requests, name) for name in settings}
    for batch in batches.values():
        sampler(logits, batch)
    timings: dict[str, list[Timing]] = {name: [] for name in settings}
    for _ in range(repeats):
        for name, batch in batches.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            sampler(logits, batch)
            timings[name].append((time.perf_counter() - start, time.process_time() - cpu_start))
    return timings


def run_sampler_bench(
    model: str,
    batch: int,
    repeats: int,
    prompt_tokens: int = 150,
    decode_steps: int = 8,
    settings: Sequence[str] = (*SETTINGS, "mixed"),
) -> dict[str, Any]:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    # every prompt prefills at once (no cap beside decodes): the bench measures decode steps, not the way in
    llm = LLM(model, device="cpu", enable_prefix_caching=False, long_prefill_token_threshold=0)
    logits, requests, step_timings = capture_decode_batch(llm, batch, prompt_tokens, decode_steps)
    timings = time_settings(logits, requests, settings, repeats)
    step_ms = statistics.median(wall for wall, _ in step_timings) * 1e3
    step_cpu_ms = statistics.median(cpu for _, cpu in step_timings) * 1e3
    results = {}
    for name in settings:
        ms = statistics.median(wall for wall, _ in timings[name]) * 1e3
        cpu_ms = statistics.median(cpu for _, cpu in timings[name]) * 1e3
        results[name] = {
            "median_ms": round(ms, 3),
            "fraction_of_step": round(ms / step_ms, 4),
            "median_cpu_ms": round(cpu_ms, 3),
            "cpu_fraction_of_step": round(cpu_ms / step_cpu_ms, 4),
        }
    worst = max(r["fraction_of_step"] for r in results.values())
    return {
        "model": model,
        "batch": batch,
        "vocab_size": int(logits.shape[-1]),
        "torch_threads": torch.get_num_threads(),
        "model_step_ms": round(step_ms, 2),
        "model_step_ms_all": [round(wall * 1e3, 2) for wall, _ in step_timings],
        "model_step_cpu_ms": round(step_cpu_ms, 2),
        "results": results,
        "settings": {name: _describe(SETTINGS[name]) if name in SETTINGS else MIXED for name in settings},
        "goal": f"every setting under {GOAL_FRACTION:.0%} of the model step",
        "goal_met": worst < GOAL_FRACTION,
        "repeats": repeats,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _describe(params: SamplingParams) -> str:
    defaults = SamplingParams()
    fields = ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty")
    changed = [
        f"{f}={getattr(params, f)}"
        for f in (*fields, "repetition_penalty")
        if getattr(params, f) != getattr(defaults, f)
    ]
    return ", ".join(changed)


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("sampler", help="sampling's cost per decode step, per setting, on real logits")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32, help="rows sampled together (default 32)")
    parser.add_argument("--repeats", type=int, default=20, help="calls per setting, median reported (default 20)")
    parser.add_argument("--quick", action="store_true", help="smoke test: batch 4, 2 repeats, greedy and typical")
    parser.add_argument("--json", action="store_true", help="one line of JSON")


def run(args: Any) -> dict[str, Any]:
    if args.batch < 1 or args.repeats < 1:
        raise ValueError(f"--batch and --repeats must be positive, got {args.batch} and {args.repeats}")
    if args.quick:
        return run_sampler_bench(args.model, 4, 2, prompt_tokens=16, decode_steps=2, settings=("greedy", "typical"))
    return run_sampler_bench(args.model, args.batch, args.repeats)
