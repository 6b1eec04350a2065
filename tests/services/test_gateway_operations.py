"""What operators rely on: request ids echoed, /v1/models, health and readiness, metrics, and draining.

The gateway runs over real loopback gRPC and a real NATS, against scripted test doubles of the balancer, prefill
and decode contracts: the `mesh` and `script` fixtures of tests/services/gateway_harness.py. The real mesh is
tested in tests/integration/.
"""

from __future__ import annotations

import json

import aiohttp
import pytest

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
            text = await response.text()
        assert 'kvmesh_gateway_requests_total{api="chat.completions",code="200",model="deepseek-tiny"}' in text
        assert "kvmesh_gateway_time_to_first_token_seconds_bucket" in text
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
