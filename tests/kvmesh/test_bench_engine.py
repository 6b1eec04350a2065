"""`kvmesh bench engine` in quick mode on a small random Llama: the report's shape and arithmetic, not speed."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.engine import QUICK, make_workload, run_engine_bench
from kvmesh.cli import build_parser

VOCAB_SIZE = 500  # LLAMA_TEST_CONFIG's
# 2 x the weights a token multiplies by in LLAMA_TEST_CONFIG: per layer q and o (96 x 96), k and v (96 x 32: 2 of
# 6 heads), gate, up and down (96 x 192); then the LM head (96 x 500)
LLAMA_FLOPS_PER_TOKEN = 2 * (3 * (2 * 96 * 96 + 2 * 96 * 32 + 3 * 96 * 192) + 96 * 500)


@pytest.fixture(scope="module")
def report(llama_reference) -> dict[str, Any]:
    path, _ = llama_reference
    # typical sampling (greedy is the default, run by the JSON-output smoke test); llama.cpp skipped with a reason
    return run_engine_bench(str(path), None, "cpu", seed=0, quick=True, sampling="typical", with_llama_cpp=True)


def test_workload_is_seeded_and_within_ranges() -> None:
    first = make_workload(6, QUICK, None, VOCAB_SIZE, random.Random("0:6"))
    assert first == make_workload(6, QUICK, None, VOCAB_SIZE, random.Random("0:6"))
    assert all(QUICK.prompt_lens[0] <= len(p) <= QUICK.prompt_lens[1] for p in first.prompts)
    assert all(QUICK.output_lens[0] <= n <= QUICK.output_lens[1] for n in first.output_lens)
    assert all(0 <= t < VOCAB_SIZE for p in first.prompts for t in p)


def test_text_prompts_are_slices_of_the_source() -> None:
    source = list(range(100, 140))
    workload = make_workload(3, QUICK, source, VOCAB_SIZE, random.Random(1))
    for prompt in workload.prompts:
        start = source.index(prompt[0])
        assert prompt == [source[(start + i) % len(source)] for i in range(len(prompt))]


def test_top_level_fields(report: dict[str, Any]) -> None:
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["torch_threads"] >= 1
    assert report["workload"]["prompts"].startswith("random token ids")  # the random Llama has no tokenizer
    assert report["workload"]["concurrencies"] == [1, 4] and report["workload"]["repeats"] == 1
    assert list(report["results"]) == ["1", "4"]
    assert report["goal_met"] is None  # no C=32 in quick mode
    assert report["workload"]["sampling"].startswith("typical (temperature 0.8, top_p 0.95, top_k 50")
    assert report["quantization"] == "none" and report["cpu_decode_kernel"] is True  # built: g++ is here
    assert report["llama_cpp"] == {
        "skipped": f"llama.cpp needs a GGUF file; {Path(report['model_path']).name} is not one"
    }
    roofline = report["roofline"]
    assert roofline["model_gflop_per_token"] == round(LLAMA_FLOPS_PER_TOKEN / 1e9, 4)
    assert roofline["roofline_tok_s"] == pytest.approx(roofline["gemm_gflops"] * 1e9 / LLAMA_FLOPS_PER_TOKEN, rel=1e-3)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_results_are_consistent(report: dict[str, Any], concurrency: int) -> None:
    result = report["results"][str(concurrency)]
    ours, batched, sequential = result["ours"], result["hf_batched"], result["hf_sequential"]
    workload = make_workload(concurrency, QUICK, None, VOCAB_SIZE, random.Random(f"0:{concurrency}"))
    assert result["num_requests"] == concurrency
    assert result["num_prompt_tokens"] == workload.num_prompt_tokens
    assert result["num_output_tokens"] == workload.num_output_tokens
    for rate in (
        ours["prefill_tok_s"],
        ours["decode_tok_s"],
        ours["useful_tok_s"],
        batched["prefill_tok_s"],
        batched["useful_tok_s"],
        sequential["useful_tok_s"],
    ):
        assert rate is not None and rate > 0
    assert ours["num_preemptions"] == 0 and ours["num_prefix_hit_tokens"] == 0
    assert batched["counted_tokens"] == sequential["counted_tokens"] == result["num_output_tokens"]
    assert batched["generated_tokens"] == concurrency * max(workload.output_lens)
    assert result["ours_vs_hf_batched"] == pytest.approx(ours["useful_tok_s"] / batched["useful_tok_s"], rel=1e-2)
    assert result["ours_vs_hf_sequential"] == pytest.approx(ours["useful_tok_s"] / sequential["useful_tok_s"], rel=1e-2)
    e2e = result["seconds"]["ours_e2e"][0]
    assert ours["useful_tok_s"] == pytest.approx(result["num_output_tokens"] / e2e, rel=1e-2)
    hf_e2e = result["seconds"]["hf_batched_e2e"][0]
    assert batched["padded_tok_s"] == pytest.approx(batched["generated_tokens"] / hf_e2e, rel=1e-2)
    roofline_tok_s = report["roofline"]["roofline_tok_s"]
    assert ours["roofline_fraction"] == pytest.approx(ours["decode_tok_s"] / roofline_tok_s, abs=1e-3)
    assert all(len(runs) == 1 for runs in result["seconds"].values())
    # Decode is timed inside each end-to-end run, so it can never come out longer than that run.
    assert list(result["decode_seconds"]) == ["ours_e2e", "hf_batched_e2e"]
    for name, spans in result["decode_seconds"].items():
        assert 0 < spans[0] < result["seconds"][name][0]
    # transformers decodes every row in one step after the prompt: its decode span holds each request's own
    # tokens after the first one.
    hf_span = result["decode_seconds"]["hf_batched_e2e"][0]
    assert batched["decode_tok_s"] == pytest.approx((workload.num_output_tokens - concurrency) / hf_span, rel=1e-2)


def test_cli_passes_the_options() -> None:
    args = build_parser().parse_args(["bench", "engine", "--quick", "--max-output-tokens", "8", "--repeats", "2"])
    assert (args.quick, args.max_output_tokens, args.repeats, args.concurrency) == (True, 8, 2, None)
    assert (args.sampling, args.quantization, args.with_llama_cpp) == ("greedy", "none", False)
    assert args.cpu_decode_kernel is True
    assert build_parser().parse_args(["bench", "engine", "--no-cpu-decode-kernel"]).cpu_decode_kernel is False
    args = build_parser().parse_args(["bench", "engine", "--sampling", "typical", "--with-llama-cpp"])
    assert (args.sampling, args.with_llama_cpp, args.llama_server) == ("typical", True, None)
    args = build_parser().parse_args(["bench", "engine", "--llama-server", "/opt/llama/llama-server"])
    assert args.llama_server == "/opt/llama/llama-server"


def test_llama_server_gets_one_slot_per_request(tmp_path: Path) -> None:
    from kvmesh.bench.llama_cpp import find_llama_server, llama_server_command, why_unavailable

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match=f"--llama-server: {binary} is not an executable file"):
        find_llama_server(str(binary))
    binary.chmod(0o755)
    assert find_llama_server(str(binary)) == binary
    gguf = tmp_path / "model.gguf"
    assert why_unavailable(gguf, binary) is None  # the binary is enough: llama-cpp-python is not needed
    assert why_unavailable(tmp_path / "model.safetensors", binary) == (
        "llama.cpp needs a GGUF file; model.safetensors is not one"
    )
    # 32 slots of 384 tokens: llama-server's --ctx-size is the total it divides among its slots
    assert llama_server_command(binary, gguf, 8080, 2, 32, 384) == [
        str(binary),
        "--model", str(gguf),
        "--host", "127.0.0.1",
        "--port", "8080",
        "--ctx-size", "12288",
        "--parallel", "32",
        "--threads", "2",
        "--threads-batch", "2",
    ]  # fmt: skip


def test_both_systems_sample_with_the_same_settings() -> None:
    from kvmesh.bench.engine import SAMPLING, _generation_kwargs

    assert _generation_kwargs(SAMPLING["typical"]) == {
        "do_sample": True,
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 50,
        "repetition_penalty": 1.1,
    }
    assert _generation_kwargs(SAMPLING["greedy"]) == {"do_sample": False}
    with pytest.raises(ValueError, match="sampling must be one of greedy, typical, got 'nucleus'"):
        replace(QUICK, sampling="nucleus")


def test_an_unknown_quantization_is_refused_naming_the_option() -> None:
    from engine_core.config import EngineConfig
    from kvmesh.bench.engine import quantization_args

    assert quantization_args("none") == {} and quantization_args("fp32") == {}
    if "quantization" in EngineConfig.__dataclass_fields__:  # the engine's int8 path has landed: it validates
        assert quantization_args("int8") == {"quantization": "int8"}
    else:
        with pytest.raises(ValueError, match="--quantization int8: this engine has no quantization setting"):
            quantization_args("int8")


def test_decode_is_timed_inside_the_run_even_when_the_prefill_run_was_slower() -> None:
    """The rate CI once saw as None: a prefill-only run slower than the end-to-end run (load elsewhere on the
    machine) left nothing for decode when decode time was one run's seconds minus the other's."""
    from kvmesh.bench.engine import Run, _decode_rate

    runs = [
        Run(seconds=0.50, decode_seconds=0.20, decode_tokens=10),
        Run(seconds=0.40, decode_seconds=0.25, decode_tokens=10),
    ]
    assert _decode_rate(runs) == 45.0  # the median of 50 and 40 tok/s, whatever a prefill run took
    assert _decode_rate([Run(seconds=0.1, decode_seconds=0.001, decode_tokens=0)]) is None


def test_runs_interleave_and_sequential_can_run_once() -> None:
    from kvmesh.bench.engine import _timed_runs

    order: list[str] = []

    def measure(name: str) -> Callable[[], float]:
        def run() -> float:
            order.append(name)
            return 1.0

        return run

    measurements = {name: measure(name) for name in ("a", "hf_sequential")}
    seconds = _timed_runs(measurements, {"a": 3, "hf_sequential": 1})
    assert order == ["a", "hf_sequential", "a", "a"]
    assert seconds == {"a": [1.0, 1.0, 1.0], "hf_sequential": [1.0]}
