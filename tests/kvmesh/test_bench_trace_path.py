"""bench/trace_path.py: one request's spans cut into the stages on the way to its first token."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvmesh.bench.otlp_sink import ReceivedSpan
from kvmesh.bench.serve import Sample

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "trace_path.py"


def received(name: str, start_s: float, duration_s: float, parent_id: str = "p") -> ReceivedSpan:
    return ReceivedSpan(
        "kvmesh-x", "x-0", "t" * 32, name, parent_id, name, "SERVER", {}, (), False, duration_s, start_s
    )


def test_the_stages_of_one_request_add_up_to_its_mesh_overhead() -> None:
    spec = importlib.util.spec_from_file_location("trace_path", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    spans = [
        received("chat m", 100.000, 0.500, parent_id=""),
        received("kvmesh.v1.Balancer/Route", 100.004, 0.001),
        received("kvmesh.v1.Prefill/PrefillStream", 100.008, 0.200),
        received("kvmesh.prefill.compute", 100.009, 0.080),
    ]
    stages = bench._stages(spans, Sample(ttft_s=0.095, prefill_s=0.081))
    expected = {
        "before_route": 4.0,
        "route": 1.0,
        "route_to_prefill": 3.0,
        "before_compute": 1.0,
        "compute": 80.0,
        "outside_spans": 6.0,
        "ttft": 95.0,
        "prefill_engine": 81.0,
        "mesh_overhead": 14.0,
    }
    assert stages == pytest.approx(expected, abs=1e-6)
