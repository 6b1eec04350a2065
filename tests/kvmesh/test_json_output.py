"""Every `--json` command prints one line of JSON on stdout and nothing else (logs go to stderr, also from the
services a bench starts in its own process): each command's smoke form runs as a subprocess and its whole stdout
parses with json.loads, so `| jq` works."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"  # tests/data/README.md
TRACE = str(DATA / "mooncake" / "conversation_trace_first300.jsonl")
TINY = ("--model", "deepseek-tiny")
QUICK_ENGINE = ("--max-output-tokens", "4", "--repeats", "1")
# the command line, and a key its report must have
COMMANDS: dict[str, tuple[tuple[str, ...], str]] = {
    "engine": (
        ("bench", "engine", *TINY, "--quick", "--concurrency", "1", "--max-prompt-tokens", "16", *QUICK_ENGINE),
        "results",
    ),
    "sampler": (("bench", "sampler", *TINY, "--quick"), "results"),
    "expert": (("bench", "expert", "--quick"), "results"),
    "kvcache": (("bench", "kvcache", "--trace", TRACE), "hit_rate"),
    "kv-transfer": (("bench", "kv-transfer", "--megabytes", "4", "--block-kib", "256", "--repeats", "1"), "store_gbps"),
    "kv-push": (("bench", "kv-push", *TINY, "--prompt-tokens", "64", "--repeats", "1"), "by_prompt_tokens"),
    "kv-index": (("bench", "kv-index", "--batches", "200"), "restored_index_equal"),
    "kv-ttft": (("bench", "kv-ttft", *TINY, "--prompt-tokens", "64"), "speedup"),
    "route": (("bench", "route", "--trace", TRACE, "--limit", "50"), "hit_rate"),
    "serve": (("bench", "serve", *TINY, "--requests", "2", "--concurrency", "1", "--max-tokens", "2"), "ttft_p50_ms"),
    "admission": (("bench", "admission", "--smoke"), "results"),
    "spans": (("bench", "spans", "--spans", "200", "--repeats", "1"), "on_cpu_us_per_span"),
    "scale": (("bench", "scale", "--index-keys", "300", "--repeats", "1"), "figures"),
    "expert-plan": (("expert-plan", "--input", str(DATA / "eplb" / "eplb_readme_example.json")), "phy2log"),
}


def run(args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvmesh", *args, "--json"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


# The slowest commands, slowest first (seconds each alone at load 10 on this 2-core machine: engine 114, serve 78,
# kv-ttft 62, kv-push 60, admission 59, sampler 46; the others 6-27). Started in COMMANDS' order, engine, serve and
# kv-ttft came 1st, 10th and 8th, and serve ran on at the end while the other two threads had nothing left.
SLOWEST_FIRST = ("engine", "serve", "kv-ttft", "kv-push", "admission", "sampler")


def start_order() -> list[str]:
    return sorted(COMMANDS, key=lambda name: SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST))


@pytest.fixture(scope="module")
def outputs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command once, three at a time, the slowest started first (longest-processing-time order: the last to
    start are the short ones, so the three threads finish close together)."""
    names = start_order()
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = pool.map(run, (COMMANDS[name][0] for name in names))
        return dict(zip(names, results, strict=True))


def test_every_command_runs_once_slowest_first() -> None:
    assert set(SLOWEST_FIRST) <= set(COMMANDS)
    names = start_order()
    assert sorted(names) == sorted(COMMANDS) and names[: len(SLOWEST_FIRST)] == list(SLOWEST_FIRST)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_stdout_is_one_line_of_json(outputs: dict[str, subprocess.CompletedProcess[str]], name: str) -> None:
    result = outputs[name]
    assert result.returncode == 0, result.stderr[-8000:]
    report = json.loads(result.stdout)
    assert COMMANDS[name][1] in report
    assert result.stdout.count("\n") == 1 and result.stdout.endswith("}\n")
