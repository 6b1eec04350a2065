"""bench/trace_cpu.py: a request's spans in every role, exported and parented as a real mesh's, priced off and on."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from mesh import tracing

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "trace_cpu.py"
ROOT_SPAN = "chat deepseek-tiny"
CLIENT_SPAN = "00f067aa0ba902b7"


def test_trace_cpu_exports_one_requests_tree_and_prices_it() -> None:
    spec = importlib.util.spec_from_file_location("trace_cpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    environment = dict(os.environ)

    result = bench.run(num_requests=20, repeats=1, num_batches=4)

    assert result["num_spans_per_request"] == 12.0
    assert result["tree"]["num_spans"] == 12
    assert result["tree"]["parents"] == {
        ROOT_SPAN: CLIENT_SPAN,
        "kvmesh.v1.Balancer/Route": ROOT_SPAN,
        "kvmesh.v1.Prefill/PrefillStream": ROOT_SPAN,
        "kvmesh.kv.read device": "kvmesh.v1.Prefill/PrefillStream",
        "kvmesh.prefill.compute": "kvmesh.v1.Prefill/PrefillStream",
        "kvmesh.kv.read store": "kvmesh.prefill.compute",
        "kvmesh.v1.KVCache/Get": "kvmesh.kv.read store",
        "kvmesh.decode.bind": "kvmesh.v1.Prefill/PrefillStream",
        "kvmesh.v1.Balancer/BindDecode": "kvmesh.decode.bind",
        "kvmesh.kv.push": "kvmesh.v1.Prefill/PrefillStream",
        "kvmesh.v1.Decode/PushKV": "kvmesh.kv.push",
        "kvmesh.v1.Decode/Stream": ROOT_SPAN,
    }
    root = result["tree"]["root_attributes"]
    assert (root["gen_ai.usage.output_tokens"], root["gen_ai.response.finish_reasons"]) == (16, ["length"])
    assert root["kvmesh.worker_id"] == "bench-0" and root["kvmesh.tenant"] == "default"
    assert 0 < result["off_calls"] < result["on_calls"]
    assert 0 < result["off_us"] < result["on_us"] and result["export_us"] > 0
    assert not tracing.is_enabled() and dict(os.environ) == environment  # left as it found them

    before = bench.run(num_requests=20, repeats=1, num_batches=4, num_consumer_spans=4)  # as the balancers were
    assert before["num_spans_per_request"] == 16.0
    assert before["on_calls"] > result["on_calls"]
