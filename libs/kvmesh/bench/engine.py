"""`kvmesh bench engine`: our engine's prefill, decode and end-to-end tokens/s against transformers.

At each concurrency C one fixed, seeded workload of C requests (mixed prompt and output lengths, greedy or
`typical` sampling, ignore_eos so every output has its exact length) runs on three systems, all in this
process on the same weights: our `LLM` (all C requests submitted at once), transformers' batched `generate`
(left-padded, one call), and transformers one request at a time. Each measurement runs `repeats` times,
interleaved across systems so that a burst of load elsewhere on the machine hits all of them alike; the median
is reported.

Prefill rates come from runs that generate one token per request. Decode rates are timed inside each
end-to-end run, from the moment every request holds its first token to the end, over the tokens generated in
that span: subtracting two separate runs' times would let noise between the runs decide the rate (or make it
negative).

Rates count useful tokens: each request's own output. transformers' batched `generate` runs every row to the
longest output; the tokens it computed that way are reported apart (`padded_tok_s`). `roofline_fraction` is our
decode rate over the machine's GEMM rate (measured in the same run) divided by the model's FLOPs per token
(`roofline.py`). `--with-llama-cpp` adds llama.cpp's server on the same GGUF (`llama_cpp.py`).
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine_core import LLM, SamplingParams, model_store
from engine_core.config import EngineConfig
from kvmesh.bench import roofline

BLOCK_SIZE = 16
# The request settings each system samples with (transformers gets the same ones, see `_generation_kwargs`).
SAMPLING = {
    "greedy": SamplingParams(temperature=0.0),
    "typical": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1),
}
# the engine-speed goals, all in one run: (concurrency, figure, at least)
GOALS = ((32, "ours_vs_hf_batched", 2.5), (32, "roofline_fraction", 0.6), (1, "ours_vs_hf_batched", 1.5))

# Prompts are slices of this text when the model has a tokenizer (real text gives the attention realistic
# inputs; the cost per token is the same either way). Slices wrap around, so any prompt length works.
PROMPT_TEXT = (
    "The harbour town woke slowly in winter. Fishing boats came in before dawn, their lamps swinging over "
    "the black water, and the men unloaded crates of cod and mackerel onto the stone quay while gulls "
    "circled overhead. By eight the bakery on the corner had sold its first trays of bread, and the old "
    "ferry, painted blue and white, sounded its horn twice before leaving for the islands. Children walked "
    "to school along the sea wall, counting the waves that broke against it, and the postmistress sorted "
    "letters from cities most of the town had never seen. In the afternoon the wind turned, carrying rain "
    "from the west; shutters banged, the market traders packed their tables early, and the lighthouse "
    "keeper climbed the hundred and twelve steps to check the lens. Evenings were for the tavern by the "
    "harbour, where sailors argued about the weather, the price of diesel and whether the new breakwater "
    "would ever be finished. Nobody was in a hurry. The tide decided most things, and everyone had long "
    "ago agreed that it was better at it than they were. Scientists who visited in summer to study the "
    "currents said the bay was unusual: a deep channel ran close to the shore, so that large ships could "
    "anchor within sight of the church, and cold water rose from the depths carrying nutrients that fed "
    "the fish. The town had known this for centuries without the charts, and it said so, politely."
)


@dataclass(frozen=True)
class EngineBenchConfig:
    concurrencies: tuple[int, ...]
    prompt_lens: tuple[int, int]  # inclusive range each prompt's length is drawn from
    output_lens: tuple[int, int]  # inclusive range each output's length is drawn from
    repeats: int  # runs per measurement
    max_repeated_sequential: int  # transformers one request at a time runs once above this many requests
    sampling: str = "greedy"  # a key of SAMPLING
    quantization: str = "none"  # the engine's quantization mode (transformers always runs float32)
    cpu_decode_kernel: bool = True  # the engine's C++ decode attention (KVMESH_CPU_DECODE_KERNEL)

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING)}, got {self.sampling!r}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be positive, got {self.concurrencies}")
        for name in ("prompt_lens", "output_lens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must satisfy 1 <= min <= max, got {low}..{high}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")


# Outputs up to 64 (not 128), and transformers one request at a time run once above C=1 (it is the costliest
# measurement, not part of the goal, and one run already spans C separate generate calls), keep the default
# run near 10 minutes on 2 idle CPU cores. The rule depends on the workload, not on a (noisy) first run.
DEFAULT = EngineBenchConfig(
    concurrencies=(1, 8, 32), prompt_lens=(32, 256), output_lens=(16, 64), repeats=3, max_repeated_sequential=1
)
QUICK = EngineBenchConfig(
    concurrencies=(1, 4), prompt_lens=(8, 32), output_lens=(4, 12), repeats=1, max_repeated_sequential=1
)


@dataclass(frozen=True)
class Run:
    """One end-to-end run: its wall seconds, and the decode span inside it."""

    seconds: float
    decode_seconds: float  # from the moment every request held its first token to the end
    decode_tokens: int  # tokens generated in that span (only each request's own, not padding rows')


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids
    output_lens: list[int]  # exact output length of each request

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int, config: EngineBenchConfig, source_ids: list[int] | None, vocab_size: int, rng: random.Random
) -> Workload:
    """Prompts are slices of `source_ids` at random offsets, or uniform random ids when it is None."""
    prompts, output_lens = [], []
    for _ in range(num_requests):
        length = rng.randint(*config.prompt_lens)
        if source_ids is None:
            prompts.append([rng.randrange(vocab_size) for _ in range(length)])
        else:
            start = rng.randrange(len(source_ids))
            prompts.append([source_ids[(start + i) % len(source_ids)] for i in range(length)])
        output_lens.append(rng.randint(*config.output_lens))
    return Workload(prompts, output_lens)


class OurSystem:
    """One `LLM` for the whole benchmark; prefix caching off because the same prompts run repeatedly."""

    def __init__(
        self, model: str, device: str, config: EngineBenchConfig, engine_args: dict[str, Any] | None = None
    ) -> None:
        """`engine_args`: further `LLM` arguments, for a bench comparing two settings of the engine."""
        # A KV cache that holds the largest workload whole: a preemption would measure the cache size instead.
        max_blocks_per_request = -(-(config.prompt_lens[1] + config.output_lens[1]) // BLOCK_SIZE)
        num_requests = max(config.concurrencies)
        self.llm = LLM(
            model,
            device=device,
            enable_prefix_caching=False,
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_requests * max_blocks_per_request,
            max_num_seqs=max(64, num_requests),
            **quantization_args(config.quantization),
            cpu_decode_kernel=config.cpu_decode_kernel,
            **(engine_args or {}),
        )
        self.sampling = SAMPLING[config.sampling]
        self.ops = self.llm.engine.ops
        self.ids = itertools.count()

    def prefill(self, workload: Workload) -> float:
        return self.run(workload, [1] * workload.num_requests).seconds

    def e2e(self, workload: Workload) -> Run:
        return self.run(workload, workload.output_lens)

    def run(self, workload: Workload, output_lens: Sequence[int]) -> Run:
        """Serve every request with the given output lengths, all submitted at once, stepping the engine
        here (as `LLM.generate` does) to see when the last request gets its first token."""
        engine = self.llm.engine
        params = [replace(self.sampling, max_tokens=n, ignore_eos=True) for n in output_lens]
        generated = dict.fromkeys((f"bench-{next(self.ids)}" for _ in params), 0)
        start = time.perf_counter()
        for request_id, prompt, param in zip(generated, workload.prompts, params, strict=True):
            engine.add_request(request_id, prompt, param)
        all_started_at, tokens_then = None, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                generated[output.request_id] += len(output.new_token_ids)
            if all_started_at is None and all(generated.values()):
                self.ops.synchronize()
                all_started_at, tokens_then = time.perf_counter(), sum(generated.values())
        self.ops.synchronize()
        end = time.perf_counter()
        assert list(generated.values()) == list(output_lens), "ignore_eos must give exact lengths"
        assert all_started_at is not None
        return Run(end - start, end - all_started_at, sum(output_lens) - tokens_then)


def quantization_args(mode: str) -> dict[str, str]:
    """The engine arguments for a `--quantization` mode; a clear error when this engine has no such setting."""
    if mode in ("none", "fp32"):
        return {}
    if "quantization" not in EngineConfig.__dataclass_fields__:
        raise ValueError(f"--quantization {mode}: this engine has no quantization setting yet (only none)")
    return {"quantization": mode}  # EngineConfig validates the mode and names the setting


class HFSystem:
    """The same weights through transformers' `generate`: what a user gets without a serving engine."""

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, sampling: SamplingParams) -> None:
        from transformers import AutoModelForCausalLM

        if path.suffix == ".gguf":  # transformers dequantizes GGUF weights to `dtype` when loading
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        self.model = model.to(device).eval()  # type: ignore[arg-type]  # transformers wraps `to`; mypy misreads it
        self.device = device
        self.sampling = _generation_kwargs(sampling)
        eos = self.model.config.eos_token_id
        self.pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], num_new_tokens: int) -> Run:
        """One `generate` over left-padded prompts; every row gets exactly num_new_tokens."""
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        config = GenerationConfig(
            **self.sampling,
            max_new_tokens=num_new_tokens,
            min_new_tokens=num_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.model.config.eos_token_id,
        )
        clock = _FirstTokenClock()
        start = time.perf_counter()
        output = self.model.generate(input_ids, attention_mask=mask, generation_config=config, streamer=clock)
        output = output.cpu()  # waits for the device
        end = time.perf_counter()
        assert output.shape == (len(prompts), width + num_new_tokens), "min_new_tokens must give exact lengths"
        assert clock.first_token_at is not None
        return Run(end - start, end - clock.first_token_at, len(prompts) * (num_new_tokens - 1))

    def batched_prefill(self, workload: Workload) -> float:
        return self._generate(workload.prompts, 1).seconds

    def batched_e2e(self, workload: Workload) -> Run:
        """One call: it cannot stop a row at its own length, so it runs every row to the longest one."""
        run = self._generate(workload.prompts, max(workload.output_lens))
        # Only each request's own tokens count: the padding rows' extra tokens are waste.
        return replace(run, decode_tokens=workload.num_output_tokens - workload.num_requests)

    def sequential(self, workload: Workload) -> float:
        return sum(self._generate([p], n).seconds for p, n in zip(workload.prompts, workload.output_lens, strict=True))


def _generation_kwargs(params: SamplingParams) -> dict[str, Any]:
    """transformers' names for the settings SAMPLING uses."""
    if params.is_greedy:
        return {"do_sample": False}
    return {
        "do_sample": True,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "repetition_penalty": params.repetition_penalty,
    }


class _FirstTokenClock:
    """A transformers streamer that notes when `generate` emits its first new tokens (the second `put`:
    the first one hands over the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()  # `value` came to the host: the step has finished

    def end(self) -> None:
        pass


def _timed_runs(
    measurements: dict[str, Callable[[], float | Run]], repeats: dict[str, int]
) -> dict[str, list[float | Run]]:
    """Every measurement's runs, one of each per round, interleaved so load bursts hit all alike."""
    runs: dict[str, list[float | Run]] = {name: [] for name in measurements}
    for round_index in range(max(repeats.values())):
        for name, measure in measurements.items():
            if round_index < repeats[name]:
                runs[name].append(measure())
    return runs


def _seconds(run: float | Run) -> float:
    return run.seconds if isinstance(run, Run) else run


def _rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 2)


def _decode_rate(runs: list[float | Run]) -> float | None:
    """Median over the end-to-end runs of each one's decode rate; None when no run decoded a token."""
    rates = [r.decode_tokens / r.decode_seconds for r in runs if isinstance(r, Run) and r.decode_tokens]
    return round(statistics.median(rates), 2) if rates else None


def _speedup(ours_s: float, theirs_s: float) -> float:
    """Our throughput over theirs on the same counted tokens: the quotient of their time by ours."""
    return round(theirs_s / ours_s, 3)


def bench_concurrency(
    ours: OurSystem, hf: HFSystem, workload: Workload, config: EngineBenchConfig, roofline_tok_s: float | None = None
) -> dict[str, Any]:
    stats_before = ours.llm.engine.stats()
    measurements: dict[str, Callable[[], float | Run]] = {
        "ours_prefill": lambda: ours.prefill(workload),
        "ours_e2e": lambda: ours.e2e(workload),
        "hf_batched_prefill": lambda: hf.batched_prefill(workload),
        "hf_batched_e2e": lambda: hf.batched_e2e(workload),
        "hf_sequential": lambda: hf.sequential(workload),
    }
    repeats = dict.fromkeys(measurements, config.repeats)
    if workload.num_requests > config.max_repeated_sequential:
        repeats["hf_sequential"] = 1
    runs = _timed_runs(measurements, repeats)
    stats_after = ours.llm.engine.stats()
    med = {name: statistics.median(_seconds(run) for run in values) for name, values in runs.items()}
    num, num_prompt, num_out = workload.num_requests, workload.num_prompt_tokens, workload.num_output_tokens
    decode_rate = _decode_rate(runs["ours_e2e"])
    ours_result = {
        "prefill_tok_s": _rate(num_prompt, med["ours_prefill"]),
        "decode_tok_s": decode_rate,
        "useful_tok_s": _rate(num_out, med["ours_e2e"]),
        "roofline_fraction": None if not (decode_rate and roofline_tok_s) else round(decode_rate / roofline_tok_s, 3),
        "num_preemptions": stats_after.num_preemptions - stats_before.num_preemptions,
        "num_prefix_hit_tokens": stats_after.num_prefix_hit_tokens - stats_before.num_prefix_hit_tokens,
    }
    batched = {
        "prefill_tok_s": _rate(num_prompt, med["hf_batched_prefill"]),
        "decode_tok_s": _decode_rate(runs["hf_batched_e2e"]),
        "useful_tok_s": _rate(num_out, med["hf_batched_e2e"]),
        "padded_tok_s": _rate(num * max(workload.output_lens), med["hf_batched_e2e"]),  # with the padding rows'
        "generated_tokens": num * max(workload.output_lens),
        "counted_tokens": num_out,  # each request's own output length; the padding rows' extra tokens are waste
    }
    sequential = {"useful_tok_s": _rate(num_out, med["hf_sequential"]), "counted_tokens": num_out}
    return {
        "num_requests": num,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_out,
        "ours": ours_result,
        "hf_batched": batched,
        "hf_sequential": sequential,
        "ours_vs_hf_batched": _speedup(med["ours_e2e"], med["hf_batched_e2e"]),
        "ours_vs_hf_sequential": _speedup(med["ours_e2e"], med["hf_sequential"]),
        "seconds": {name: [round(_seconds(run), 6) for run in values] for name, values in runs.items()},
        "decode_seconds": {
            name: [round(run.decode_seconds, 6) for run in values if isinstance(run, Run)]
            for name, values in runs.items()
            if name.endswith("e2e")
        },
    }


def _prompt_source(llm: LLM) -> list[int] | None:
    tokenizer = llm.tokenizer
    return None if tokenizer is None else tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)


def _warm_up(ours: OurSystem, hf: HFSystem, workload: Workload) -> None:
    """First calls pay one-time costs (allocator growth, lazy imports, kernel selection) not worth measuring."""
    ours.prefill(workload)
    ours.e2e(workload)
    hf.batched_e2e(workload)
    hf.sequential(workload)


def bench_config(
    concurrencies: Sequence[int] | None,
    quick: bool,
    max_prompt_tokens: int | None,
    max_output_tokens: int | None,
    repeats: int | None,
) -> EngineBenchConfig:
    base = QUICK if quick else DEFAULT
    prompt_max = max_prompt_tokens or base.prompt_lens[1]
    output_max = max_output_tokens or base.output_lens[1]
    return EngineBenchConfig(
        concurrencies=tuple(concurrencies or base.concurrencies),
        prompt_lens=(min(base.prompt_lens[0], prompt_max), prompt_max),
        output_lens=(min(base.output_lens[0], output_max), output_max),
        repeats=repeats or base.repeats,
        max_repeated_sequential=base.max_repeated_sequential,
    )


def run_engine_bench(
    model: str,
    concurrencies: Sequence[int] | None,
    device: str,
    seed: int,
    *,
    quick: bool = False,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    repeats: int | None = None,
    sampling: str = "greedy",
    quantization: str = "none",
    cpu_decode_kernel: bool = True,
    with_llama_cpp: bool = False,
    llama_server: str | None = None,
) -> dict[str, Any]:
    """The whole benchmark as a JSON-ready dict (see the module docstring for what is measured).
    `llama_server`: llama.cpp's llama-server binary (implies `with_llama_cpp`); else one on PATH is used."""
    config = replace(
        bench_config(concurrencies, quick, max_prompt_tokens, max_output_tokens, repeats),
        sampling=sampling,
        quantization=quantization,
        cpu_decode_kernel=cpu_decode_kernel,
    )
    binary = None
    if with_llama_cpp or llama_server is not None:
        from kvmesh.bench.llama_cpp import find_llama_server

        with_llama_cpp, binary = True, find_llama_server(llama_server)  # a bad path fails here, before any run
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    path = model_store.resolve(model)
    ours = OurSystem(model, device, config)
    hf = HFSystem(path, ours.ops.torch_device, ours.llm.engine.dtype, ours.sampling)
    source_ids, vocab_size = _prompt_source(ours.llm), ours.llm.engine.model_config.vocab_size
    workloads = {
        c: make_workload(c, config, source_ids, vocab_size, random.Random(f"{seed}:{c}")) for c in config.concurrencies
    }
    shortest = replace(config, prompt_lens=(config.prompt_lens[0],) * 2, output_lens=(config.output_lens[0],) * 2)
    warmup = make_workload(2, shortest, source_ids, vocab_size, random.Random(f"{seed}:warmup"))
    _warm_up(ours, hf, warmup)
    machine = roofline.measure(ours.llm.engine.runner.model, ours.llm.engine.model_config)
    results = {str(c): bench_concurrency(ours, hf, w, config, machine["roofline_tok_s"]) for c, w in workloads.items()}
    llama_cpp = _with_llama_cpp(path, ours, workloads, results, config, binary) if with_llama_cpp else None
    return {
        "model": model,
        "model_path": str(path),
        "device": ours.ops.name,
        "dtype": str(ours.llm.engine.dtype).removeprefix("torch."),
        "quantization": config.quantization,
        "cpu_decode_kernel": getattr(ours.ops, "decode_kernel", None) is not None,
        "torch_threads": torch.get_num_threads(),
        "workload": _describe(config, seed, source_ids is not None),
        "roofline": machine,
        "results": results,
        "llama_cpp": llama_cpp,
        "goal": ", ".join(f"{figure} at C={c} >= {least}" for c, figure, least in GOALS),
        "goal_met": _goal_met(results),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _goal_met(results: dict[str, Any]) -> bool | None:
    """Whether every goal holds in this run; None when a concurrency a goal names was not run."""
    figures = []
    for concurrency, figure, least in GOALS:
        result = results.get(str(concurrency))
        if result is None:
            return None
        figures.append((result["ours"] if figure == "roofline_fraction" else result)[figure] >= least)
    return all(figures)


def _describe(config: EngineBenchConfig, seed: int, is_text: bool) -> dict[str, Any]:
    prompts = (
        "slices of a fixed English paragraph, tokenized by the model's tokenizer"
        if is_text
        else "random token ids, uniform over the vocabulary (the model has no tokenizer)"
    )
    return {
        "prompts": prompts,
        "prompt_tokens": list(config.prompt_lens),
        "output_tokens": list(config.output_lens),
        "seed": seed,
        "sampling": f"{config.sampling} ({_settings(SAMPLING[config.sampling])}), ignore_eos (ours) / "
        "min_new_tokens = max_new_tokens (transformers): exact lengths",
        "repeats": config.repeats,
        "statistic": (
            "median of `repeats` runs, interleaved across systems, after one warm-up run per system; "
            f"hf_sequential runs once above C={config.max_repeated_sequential}; "
            "every run's seconds under `seconds`"
        ),
        "concurrencies": list(config.concurrencies),
    }


def _settings(params: SamplingParams) -> str:
    if params.is_greedy:
        return "argmax"
    return (
        f"temperature {params.temperature}, top_p {params.top_p}, top_k {params.top_k}, "
        f"repetition_penalty {params.repetition_penalty}"
    )


def _with_llama_cpp(
    path: Path,
    ours: OurSystem,
    workloads: dict[int, Workload],
    results: dict[str, Any],
    config: EngineBenchConfig,
    llama_server: Path | None,
) -> dict[str, Any]:
    """llama.cpp's server on the same GGUF, each workload `repeats` times after ours (not interleaved: its
    server is a separate process); figures go into each concurrency's results, the setup into the return.
    llama-server is started per concurrency with that many parallel slots; llama-cpp-python's server once."""
    from kvmesh.bench.llama_cpp import CPP_SERVER, PYTHON_SERVER, LlamaCppServer, why_unavailable

    tokenizer = ours.llm.tokenizer
    reason = why_unavailable(path, llama_server) or (None if tokenizer is not None else "the model has no tokenizer")
    if reason is not None:
        print(f"kvmesh bench engine: llama.cpp {reason}", file=sys.stderr)
        return {"skipped": reason}
    context = config.prompt_lens[1] + config.output_lens[1] + 64  # room for re-tokenization differences
    threads = torch.get_num_threads()
    eos = sorted(ours.llm.engine.eos_token_ids)
    # llama-cpp-python's server once for every workload; llama-server per workload, its slots = the concurrency
    shared = None if llama_server else LlamaCppServer(path, threads, context)
    try:
        for concurrency, workload in workloads.items():
            server = shared or LlamaCppServer(path, threads, context, llama_server=llama_server, slots=concurrency)
            try:
                prompts = [tokenizer.decode(p) for p in workload.prompts]
                runs = [server.run(prompts, workload.output_lens, ours.sampling, eos) for _ in range(config.repeats)]
            finally:
                if server is not shared:
                    server.stop()
            seconds = statistics.median(r[0] for r in runs)
            tokens = runs[0][1]
            result = results[str(concurrency)]
            result["llama_cpp"] = {"useful_tok_s": _rate(tokens, seconds), "completion_tokens": tokens}
            result["ours_vs_llama_cpp"] = round(result["ours"]["useful_tok_s"] / (tokens / seconds), 3)
            result["seconds"]["llama_cpp"] = [round(r[0], 6) for r in runs]
    finally:
        if shared is not None:
            shared.stop()
    kind = {"server": CPP_SERVER, "binary": str(llama_server)} if llama_server else {"server": PYTHON_SERVER}
    return {**kind, "gguf": str(path), "threads": threads}
