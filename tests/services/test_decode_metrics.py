"""Decode's engine gauges, under kvmesh's names and the ones vLLM's dashboards chart (kvmesh:X for vllm:X)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from engine_core import EngineStats
from services.decode.server import export_metrics


def test_kv_usage_and_the_queue_are_exported_per_model_as_vllm_names_them() -> None:
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        num_kv_blocks=100,
        num_free_kv_blocks=75,
        kv_usage=0.25,
        num_prompt_tokens_computed=0,
        num_prefix_hit_tokens=0,
        num_generated_tokens=40,
        num_preemptions=0,
        num_evictions=0,
        num_kv_tokens=400,
        num_queued_prompt_tokens=0,
    )
    export_metrics({"gauge-test-model": stats})
    labels = {"model_name": "gauge-test-model"}
    assert REGISTRY.get_sample_value("kvmesh:kv_cache_usage_perc", labels) == 0.25
    assert REGISTRY.get_sample_value("kvmesh:num_requests_running", labels) == 3
    assert REGISTRY.get_sample_value("kvmesh:num_requests_waiting", labels) == 2
    assert REGISTRY.get_sample_value("kvmesh_decode_running_requests", {"model": "gauge-test-model"}) == 3
