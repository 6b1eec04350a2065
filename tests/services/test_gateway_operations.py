"""What operators rely on: request ids echoed, /v1/models, health and readiness, metrics, draining, and
`kvmesh bench serve --url` measuring a deployment with its own API key.

Harness: the `mesh` and `script` fixtures of tests/services/gateway_harness.py (scripted workers).
"""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cli import main
from mesh.metrics import OTEL_DURATION_BUCKETS, OTEL_TOKEN_BUCKETS, OTEL_TPOT_BUCKETS, OTEL_TTFT_BUCKETS

from . import gateway_harness
from .gateway_harness import KEY, MODEL, Mesh, Script, post

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, script = gateway_harness.mesh, gateway_harness.script  # fixtures: each test file starts its own gateway


async def test_client_request_id_is_echoed(mesh: Mesh, script: Script) -> None:
    status, headers, _ = await post(
        mesh,
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        headers={"x-request-id": "client-req-42"},
    )
    assert status == 200 and headers["x-request-id"] == "client-req-42"
    assert script.prefills[0].request_id.startswith("client-req-42-")  # unique in the mesh


async def test_models_health_ready_metrics(mesh: Mesh, script: Script) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{mesh.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as response:
            body = await response.json()
        assert body["object"] == "list"
        assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
            (MODEL, "model", "kvmesh", mesh.model.context_len)
        ]
        async with session.get(f"{mesh.base_url}/v1/models") as response:
            assert response.status == 401
        for path in ("/healthz", "/readyz"):
            async with session.get(f"{mesh.base_url}{path}") as response:
                assert response.status == 200
        async with session.get(f"{mesh.base_url}/metrics") as response:
            assert response.status == 401  # the public port's /metrics wants the admin key
        async with session.get(f"{mesh.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 403  # a client's key is not enough
        async with session.get(mesh.metrics_url) as response:  # the scrapers' port: no key
            text = await response.text()
        assert (
            'kvmesh_gateway_requests_total{api="chat.completions",code="200",model="deepseek-tiny",tenant="default"}'
            in text
        )
        assert "kvmesh_gateway_time_to_first_token_seconds_bucket" in text
        families = {family.name: family for family in text_string_to_metric_families(text)}
        for name, buckets in (
            ("kvmesh:time_to_first_token_seconds", OTEL_TTFT_BUCKETS),
            ("kvmesh:inter_token_latency_seconds", OTEL_TPOT_BUCKETS),
            ("kvmesh:e2e_request_latency_seconds", OTEL_DURATION_BUCKETS),
            ("kvmesh:request_prompt_tokens", OTEL_TOKEN_BUCKETS),
            ("kvmesh:request_generation_tokens", OTEL_TOKEN_BUCKETS),
        ):
            served = [s for s in families[name].samples if s.labels.get("model_name") == MODEL]
            # the registry is the process's: tenants of test modules run before this one in the worker are there too
            assert "default" in {s.labels["tenant"] for s in served}
            assert sorted({float(s.labels["le"]) for s in served if "le" in s.labels}) == [*buckets, math.inf]
        async with session.get(f"{mesh.base_url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 404 and (await response.json())["error"]["code"] == "not_found"


async def test_draining_refuses_new_requests(mesh: Mesh, script: Script) -> None:
    lifecycle = mesh.gateway.runtime.lifecycle
    lifecycle.draining = True
    try:
        status, _, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        async with aiohttp.ClientSession() as session, session.get(f"{mesh.base_url}/readyz") as response:
            ready_status = response.status
    finally:
        lifecycle.draining = False
    assert (status, json.loads(raw)["error"]["code"], ready_status) == (503, "service_unavailable", 503)
    assert script.routes == []


async def test_bench_serve_measures_a_running_gateway_with_its_api_key(
    mesh: Mesh, script: Script, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def bench(*key: str) -> int:  # asyncio.run inside: on a thread, off this test's loop
        argv = ["bench", "serve", "--url", mesh.base_url, *key, "--model", MODEL, "--requests", "1"]
        return main([*argv, "--concurrency", "1", "--max-tokens", "4", "--prompt-words", "4", "--json"])

    refused = f"kvmesh: error: the gateway at {mesh.base_url} refused the API key: pass its key with --api-key or"
    monkeypatch.setenv("KVMESH_API_KEY", "sk-wrong")  # the default, read when the command line is parsed
    assert await asyncio.to_thread(bench) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"{refused} KVMESH_API_KEY"
    assert await asyncio.to_thread(bench, "--api-key", "sk-wrong-too") == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"{refused} KVMESH_API_KEY"
    assert script.prefills == []

    assert await asyncio.to_thread(bench, "--api-key", "sk-other") == 0  # the flag wins over the variable
    report = json.loads(capsys.readouterr().out)
    assert (report["model"], report["requests"], report["concurrency"]) == (MODEL, 1, 1)
    assert len(script.prefills) == 3  # two warm-up requests, then the one measured
