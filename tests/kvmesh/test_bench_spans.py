"""`kvmesh bench spans`: the span cost figures, with every span it made on reaching the receiver."""

from __future__ import annotations

import json

from kvmesh.cli import main
from mesh import tracing


def test_bench_spans_prices_a_span_off_and_on_and_exports_every_one(capsys) -> None:
    assert main(["bench", "spans", "--spans", "200", "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["num_spans"], result["repeats"], result["num_exported"]) == (200, 2, 400)
    assert 0 < result["off_cpu_us_per_span"] < result["on_cpu_us_per_span"]
    assert result["encode_cpu_us_per_span"] > 0
    assert not tracing.is_enabled()  # the bench leaves the process as it found it
