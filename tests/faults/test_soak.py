"""`kvmesh bench soak`, short: mixed traffic (chat, tools, images, Responses follow-ups) on the fault suite's
mesh, every request whole, latency bucketed, every process's memory sampled and its slope computed."""

from __future__ import annotations

import json
import math

from kvmesh.bench.load import KINDS
from kvmesh.bench.soak import run_soak, slope_per_minute
from kvmesh.up import Mesh
from tests.integration.conftest import API_KEY


def test_slope_is_least_squares_in_mb_per_minute() -> None:
    assert slope_per_minute([(0.0, 100.0), (30.0, 100.5), (60.0, 101.0)]) == 1.0
    assert slope_per_minute([(0.0, 50.0), (10.0, 52.0), (20.0, 50.0), (30.0, 52.0)]) == 2.4
    assert slope_per_minute([(5.0, 80.0)]) is None


def test_a_short_soak_of_mixed_traffic_has_no_errors(fault_mesh: Mesh) -> None:
    """Runs before the faults (test_survival.py), on every replica. The warm-up is the cold mesh's: each prefill
    and decode worker compiles the tool's grammar on its first tool request, which on a busy CPU can pass the
    10 s compile deadline for deepseek-tiny's vocabulary (docs/reliability.md)."""
    processes = {c.name: c.process.pid for c in fault_mesh.children if c.process.poll() is None}
    result = run_soak(
        20, 4, url=fault_mesh.base_url, api_key=API_KEY, warmup_s=30, bucket_s=10, sample_s=1, processes=processes
    )
    print(json.dumps(result))
    assert result["errors_by_kind"] == {}, result["error_details"]
    assert set(result["requests_by_kind"]) == set(KINDS)
    assert [b["from_s"] for b in result["buckets"]] == [0.0, 10.0]
    assert sum(b["num_requests"] for b in result["buckets"]) == result["num_requests"]
    assert set(result["memory"]) == set(processes)
    for name, memory in result["memory"].items():
        assert memory["num_samples"] >= 15, name
        assert math.isfinite(memory["slope_mb_per_min"]), name
