"""`kvmesh bench kv-transfer` end to end, small: a real kvcache node process, its bulk lane and gRPC, a raw socket.
Figures are not asserted (a benchmark, on a noisy machine); that every path moved every byte is (the bench checks
the blocks it reads back), and the report's fields and their arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_the_transfer_bench_moves_every_byte_on_every_path_and_reports_the_ratio() -> None:
    output = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "bench",
            "kv-transfer",
            "--megabytes",
            "8",
            "--block-kib",
            "256",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    report = json.loads(output.strip().splitlines()[-1])
    assert report["megabytes"] == 8.0 and report["block_bytes"] == 256 * 1024 and report["repeats"] == 1
    for name in (
        "store_gbps",
        "raw_tcp_gbps",
        "raw_tcp_same_memory_gbps",
        "store_grpc_stream_gbps",
        "store_fetch_gbps",
        "store_put_gbps",
    ):
        assert report[name] > 0, name
    # the ratios of the unrounded figures: within the rounding of the two printed ones
    assert report["ratio"] == pytest.approx(report["store_gbps"] / report["raw_tcp_gbps"], abs=2e-3)
    same_memory = report["store_gbps"] / report["raw_tcp_same_memory_gbps"]
    assert report["ratio_same_memory"] == pytest.approx(same_memory, abs=2e-3)
