"""`kvmesh bench scale`: the model's arithmetic exactly, on fixed inputs (every measured one passed as a flag), and
the measured path at a small size: it runs and gives positive, sane costs."""

from __future__ import annotations

from typing import Any

from kvmesh.bench.scale import run_scale_bench
from kvmesh.bench.scale_model import DEFAULTS, MEASURED
from kvmesh.cli import build_parser

FIXED = {
    "index-bytes-per-key": "220",
    "index-bytes-per-holding": "200",
    "index-apply-us-per-key": "10",
    "event-batch-bytes": "608",
    "snapshot-bytes-per-holding": "37",
    "restore-holdings-per-s": "100000",
    "route-us": "250",
    "apply-assignment-us": "50",
}


def _report(*argv: str) -> dict[str, Any]:
    return run_scale_bench(build_parser().parse_args(["bench", "scale", *argv]))


def test_fixed_inputs_give_exact_figures() -> None:
    report = _report("--gpus", "1000", *(x for name, value in FIXED.items() for x in (f"--{name}", value)))
    assert {i["kind"] for i in report["inputs"].values()} == {"seed", "published", "assumption", "given"}
    assert report["inputs"]["route_us"] == {"value": 250.0, "kind": "given", "source": "--route-us"}
    f = report["figures"]
    assert (f["nodes"], f["traffic"]["requests_per_s"]) == (125, 969.8)  # 3,879,000 input tokens/s / 4,000
    assert (f["traffic"]["prefill_nodes"], f["traffic"]["decode_nodes"]) == (53, 73)
    store = f["store"]
    assert store["block_bytes"] == 70_272 * 16
    assert (store["logical_pb"], store["physical_pb"]) == (14.4, 17.28)  # x 12/10
    assert store["blocks"] == int(14.4e15 / 1_124_352) == 12_807_377_049
    assert (store["nodes_by_capacity"], store["nodes_by_network"], store["nodes"]) == (78, 9, 78)
    assert (store["retention_days_at_write_rate"], store["capacity_evicts_before_ttl"]) == (1.4, True)
    index = f["index"]
    assert index["device_blocks"] == int(1000 * 40e9 / 1_124_352) == 35_576_047
    assert index["every_tier"]["gib"] == 31264.75
    events = f["kv_events"]
    assert events["device_keys_per_s"] == 2 * (2 * 3_879_000 + 1_072_000) / 16 == 1_103_750
    assert events["store_keys_per_s"] == 5_085_369.0  # 1,695,123 computed tokens/s / 16 x 12 fragments x 4
    assert (events["batches_per_s"], events["shards"], events["cell_streams"]) == (386_819.9, 8, 17)
    assert f["snapshot"]["device_and_host"] == {"gbytes": 14.46, "restore_s": 3907.7}
    assert f["lanes"]["prefill_node_out_gbytes_per_s"] == 7.895  # 73,700 x 70,272 B (push) + 43.7% x 1.2 (writes)
    assert f["lanes"]["lane_processes_per_prefill_node"] == 4
    balancer = f["balancer"]
    assert (balancer["cell_gpus"], balancer["cells"], balancer["replicas_per_cell"], balancer["replicas"]) == (
        62,
        17,
        2,
        34,
    )
    assert balancer["core_load_per_replica"] == 0.658
    assert f["gateway"] == {"cores": 53.6, "replicas": 77, "admission_load": 0.485}
    assert f["limits"]["balancer_index_memory_gib"]["ratio"] == 488.512
    assert f["breaks_first"] == "balancer_index_memory_gib"


def test_figures_scale_with_gpus() -> None:
    flags = [x for name, value in FIXED.items() for x in (f"--{name}", value)]
    small, large = (_report("--gpus", str(n), *flags)["figures"] for n in (100, 200))
    assert abs(large["store"]["blocks"] - 2 * small["store"]["blocks"]) <= 1  # int() of a fraction
    assert large["kv_events"]["keys_per_s"] == 2 * small["kv_events"]["keys_per_s"]
    assert large["balancer"]["cells"] >= small["balancer"]["cells"]


def test_measured_path_runs_and_is_sane() -> None:
    report = _report("--gpus", "1000", "--index-keys", "300", "--repeats", "1", "--prompt-tokens", "512")
    inputs = report["inputs"]
    assert {inputs[name]["kind"] for name in MEASURED} == {"measured"}
    assert set(inputs) == set(DEFAULTS)
    assert 50 < inputs["index_bytes_per_key"]["value"] < 5_000
    assert 20 < inputs["index_bytes_per_holding"]["value"] < 5_000
    assert 32 < inputs["snapshot_bytes_per_holding"]["value"] < 100  # a 32-byte key, its fragment, mask and coding
    assert 16 * 32 < inputs["event_batch_bytes"]["value"] < 16 * 64
    for name in ("index_apply_us_per_key", "restore_holdings_per_s", "route_us", "apply_assignment_us"):
        assert inputs[name]["value"] > 0
    f = report["figures"]
    assert f["balancer"]["cells"] >= 1 and f["balancer"]["replicas"] >= 2
    assert f["index"]["every_tier"]["gib"] > f["index"]["device_and_host"]["gib"] > 0


def test_every_command_prints_its_help() -> None:
    """argparse formats help text with %: an input's source quoting "56.3%" once broke `kvmesh bench scale --help`."""
    import argparse

    def walk(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += walk(sub)
        return found

    parsers = walk(build_parser())
    assert len(parsers) > 20
    for parser in parsers:
        assert parser.format_help().startswith("usage: ")
