"""The gate catches real regressions, on real meshes (`kvmesh up`'s launcher: NATS, every role a process, mutual
TLS) serving deepseek-tiny. A baseline is recorded on mesh A for two short workloads: multi-turn conversations
over a long document, and greedy requests on all three APIs with their golden answers (recorded from mesh A
itself) and a schema check. Then (each TTFT comparison against a baseline recorded on mesh A just before it):

(a) a second run on mesh A passes the gate (exit 0); a baseline from another workload, and a malformed line under
    --strict, are refused (exit 2) before any request;
(b) mesh B, without a KV store and with prefix caching off, fails on TTFT for the conversations (exit 1):
    later turns recompute the whole history;
(c) mesh B also serves another deepseek-tiny (other random weights) under the same name: it fails the golden
    check on the requests.

One mesh B for (b) and (c) saves a mesh start (20-30 s); each case stays attributable because each workload is
gated on its own metrics: the conversations on TTFT only (other weights of the same shape compute as fast),
the requests on golden answers and checks only (the KV store and prefix caching change no greedy token: the
rest of the suite holds them to exact parity).

Each mesh serving the requests answers one unmeasured run first: on a loaded machine a worker can take over 10 s
to compile a model's first grammar, which fails that request (the workers' deadline) rather than waiting.

About a minute on two quiet cores (two meshes start, 20-30 s each); two to four when the machine is shared.
EVAL_GATE_LONG=1 runs the long version (six conversations over 1,500 words, 8 repeats): a benchmark, not part of
the suite.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_core.tiny import write_deepseek_tiny
from kvmesh.cli import main
from kvmesh.up import Mesh
from tests.integration.conftest import API_KEY, start_mesh

MODEL = "deepseek-tiny"
IS_LONG = os.environ.get("EVAL_GATE_LONG") == "1"
NUM_CONVERSATIONS, NUM_DOCUMENT_WORDS, NUM_REPEATS = (6, 1500, 8) if IS_LONG else (2, 800, 5)
# the long version is a benchmark: on a shared machine its uncached mesh alone can take longer than the suite's 600 s
pytestmark = [pytest.mark.timeout(3600)] if IS_LONG else []
# TTFT on the conversations, quality on the requests. The machine is shared, so load alone moves TTFT between two
# runs on one mesh (CI: p50 110 -> 211 ms, then 83 -> 221 ms, minutes apart): each TTFT comparison takes a baseline
# recorded just before it (conversations_baseline_now). The uncached mesh's p50 was 4.6x the baseline's (186 -> 850
# ms, 2026-12-06, load 6-10): a threshold of 120% (2.2x) fails it with a factor of two to spare (4.6 / 2.2) and
# leaves room for what load does within the few seconds between two back-to-back runs.
THRESHOLDS = {"conversations": "ttft_p50=120%", "requests": "golden=0,checks=0"}
WORDS = ["river", "stone", "cloud", "garden", "lantern", "harbor", "meadow", "signal", "copper", "violet", "orbit"]


def write_conversations(path: Path) -> Path:
    rng = random.Random(0)
    with open(path, "w") as file:
        for index in range(NUM_CONVERSATIONS):
            document = [rng.choice(WORDS) for _ in range(NUM_DOCUMENT_WORDS)]
            turns = [
                ("human", f"Notes {index}: {' '.join(document)}. Which word comes first?"),
                ("gpt", f"The first word is {document[0]}."),
                ("human", "And which word comes last?"),
                ("gpt", f"The last word is {document[-1]}."),
                ("human", "Which word appears most often?"),
                ("gpt", f"The word {document[1]}."),
                ("human", "Thank you. Which word comes second?"),
            ]
            file.write(json.dumps({"conversations": [{"from": who, "value": text} for who, text in turns]}) + "\n")
    return path


SCHEMA = {  # short enough that a random model, held by the grammar, closes it within max_tokens
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
REQUESTS: list[dict[str, Any]] = [
    {"api": "chat", "body": {"model": MODEL, "messages": [{"role": "user", "content": "Name a river."}]}},
    {"api": "chat", "body": {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}]}},
    {"api": "responses", "body": {"model": MODEL, "input": "Describe a harbor.", "max_output_tokens": 12}},
    {"api": "messages", "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}]}},
    {
        "api": "chat",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "A city as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        },
        "checks": [{"type": "json_schema"}],
    },
]


def write_requests(path: Path, golden: list[str] | None = None) -> Path:
    with open(path, "w") as file:
        for index, line in enumerate(REQUESTS):
            body = {"temperature": 0, **line["body"]}
            if line["api"] != "responses":
                body["max_tokens"] = 32 if "response_format" in body else 12
            written = {**line, "body": body}
            if golden is not None:
                written["expected_text"] = golden[index]
            file.write(json.dumps(written) + "\n")
    return path


def evaluate(mesh: Mesh, workload: Path, output: Path, *extra: str) -> int:
    """`kvmesh eval run` (its exit code); `--baseline B` gates on B with the workload's THRESHOLDS."""
    if "--baseline" in extra:
        extra = (*extra, "--max-regression", THRESHOLDS[workload.stem])
    return main(
        [
            "eval", "run", "--workload", str(workload), "--output", str(output), "--url", mesh.base_url,
            "--api-key", API_KEY, "--admin-key", mesh.admin_key, "--model", MODEL, "--repeats", str(NUM_REPEATS),
            "--concurrency", "2", "--max-output-tokens", "4", *extra,
        ]
    )  # fmt: skip


def warm_up(mesh: Mesh, workload: Path) -> None:
    """One unmeasured run: the workers compile their first grammar (which may fail a request, see above)."""
    assert evaluate(mesh, workload, workload.with_suffix(".warm-up.json"), "--repeats", "1") == 0


def summary(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["summary"]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Mesh A, and the baselines recorded on it; yields the workloads and result paths, mesh A under "mesh"."""
    directory = tmp_path_factory.mktemp("eval-gate")
    mesh = start_mesh(directory / "mesh-a.log", encoder=0, models=(MODEL,))
    try:
        conversations = write_conversations(directory / "conversations.jsonl")
        plain = write_requests(directory / "plain.jsonl")
        warm_up(mesh, plain)
        first = directory / "first.json"
        assert evaluate(mesh, plain, first, "--repeats", "1") == 0
        assert summary(first)["error_rate"]["values"] == [0.0]
        golden = golden_texts(first)
        assert len(golden) == len(REQUESTS) and all(golden)
        requests = write_requests(directory / "requests.jsonl", golden)
        paths = {"conversations": conversations, "requests": requests, "dir": directory}
        assert evaluate(mesh, conversations, directory / "conversations-baseline.json") == 0
        assert evaluate(mesh, requests, directory / "requests-baseline.json") == 0
        yield {**paths, "mesh": mesh}  # type: ignore[dict-item]
    finally:
        mesh.stop()


def golden_texts(result: Path) -> list[str]:
    """Each request's answer in the workload's line order (records come in the order requests finished)."""
    records = json.loads(result.read_text())["repeats"][0]["requests"]
    return [r["text"] for r in sorted(records, key=lambda r: int(r["source"].rsplit(":", 1)[1]))]


def conversations_baseline_now(baselines: dict[str, Any], name: str) -> Path:
    """The conversations' baseline recorded on mesh A just before the run it is compared with: TTFT is judged
    against the machine's load of that moment, not the fixture's (CI saw one mesh's p50 go 83 -> 221 ms between
    the fixture's baseline and a run minutes later, the other worker's tests having started meanwhile)."""
    path = baselines["dir"] / f"conversations-baseline-{name}.json"
    assert evaluate(baselines["mesh"], baselines["conversations"], path) == 0
    return path


def test_a_second_run_on_the_same_mesh_passes(baselines: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    directory, mesh = baselines["dir"], baselines["mesh"]
    baseline = summary(directory / "conversations-baseline.json")
    assert baseline["cached_ratio"]["mean"] > 0.5  # two turns in three find the history cached
    assert baseline["error_rate"]["values"] == [0.0] * NUM_REPEATS
    assert summary(directory / "requests-baseline.json")["golden"]["values"] == [1.0] * NUM_REPEATS
    references = {
        "conversations": conversations_baseline_now(baselines, "again"),
        "requests": directory / "requests-baseline.json",  # gated on answers alone: load cannot move them
    }
    for name, reference in references.items():
        again = directory / f"{name}-again.json"
        code = evaluate(mesh, baselines[name], again, "--baseline", str(reference))
        assert code == 0, capsys.readouterr().out
    assert summary(directory / "requests-again.json")["checks"]["values"] == [1.0] * NUM_REPEATS
    capsys.readouterr()
    other = evaluate(
        mesh,
        baselines["conversations"],
        directory / "refused.json",
        "--baseline",
        str(directory / "requests-baseline.json"),
    )
    assert other == 2 and "the baseline was measured on another workload" in capsys.readouterr().err
    malformed = directory / "malformed.jsonl"
    malformed.write_text(json.dumps(REQUESTS[0]) + "\n{oops\n")
    assert evaluate(mesh, malformed, directory / "strict.json", "--strict") == 2
    assert f"kvmesh: error: {malformed}:2: not JSON" in capsys.readouterr().err
    assert not (directory / "refused.json").exists() and not (directory / "strict.json").exists()


@pytest.fixture(scope="module")
def mesh_b(baselines: dict[str, Any]) -> Iterator[Mesh]:
    """No KV store, prefix caching off, and another deepseek-tiny (same architecture and name, other weights)."""
    directory = baselines["dir"]
    write_deepseek_tiny(directory / "models" / MODEL, seed=1)
    mesh = start_mesh(
        directory / "mesh-b.log",
        {
            "KVMESH_KVCACHE_ENABLED": "false",
            "KVMESH_PREFIX_CACHING_ENABLED": "false",
            "KVMESH_MODEL_DIR": str(directory / "models"),
        },
        encoder=0,
        kvcache=0,
        models=(MODEL,),
    )
    try:
        warm_up(mesh, baselines["requests"])
        yield mesh
    finally:
        mesh.stop()


def test_no_kv_store_and_no_prefix_caching_fails_on_ttft(
    baselines: dict[str, Any], mesh_b: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = baselines["dir"]
    reference = conversations_baseline_now(baselines, "uncached")
    capsys.readouterr()
    result = directory / "conversations-uncached.json"
    code = evaluate(mesh_b, baselines["conversations"], result, "--baseline", str(reference))
    out = capsys.readouterr()
    assert code == 1, out.out
    assert [line.split()[0] for line in out.out.splitlines() if "REGRESSED" in line] == ["ttft_p50"]
    assert "regressed: ttft_p50" in out.err
    assert summary(result)["cached_ratio"]["values"] == [0.0] * NUM_REPEATS


def test_another_model_under_the_same_name_fails_the_golden_check(
    baselines: dict[str, Any], mesh_b: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = baselines["dir"]
    capsys.readouterr()
    result = directory / "requests-other-model.json"
    code = evaluate(mesh_b, baselines["requests"], result, "--baseline", str(directory / "requests-baseline.json"))
    out = capsys.readouterr()
    assert code == 1, out.out
    assert [line.split()[0] for line in out.out.splitlines() if "REGRESSED" in line] == ["golden"]
    assert summary(result)["golden"]["values"] == [0.0] * NUM_REPEATS
    assert summary(result)["checks"]["values"] == [1.0] * NUM_REPEATS  # the grammar still holds the schema
