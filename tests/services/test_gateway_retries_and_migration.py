"""A failing worker: the gateway retries without it, maps what cannot be retried to the client's status, and
migrates a request whose decode fails mid-stream so the output goes on.

Harness: the `mesh` and `script` fixtures of tests/services/gateway_harness.py (scripted workers).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Mapping

import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY

from services.gateway.mesh_view import MeshView

from . import gateway_harness
from .gateway_harness import COMPLETION, MODEL, Mesh, Script, post, sse_events, wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, script = gateway_harness.mesh, gateway_harness.script  # fixtures: each test file starts its own gateway


async def test_retry_excludes_the_failed_decode_worker(mesh: Mesh, script: Script) -> None:
    script.prefill_failures = [(grpc.StatusCode.UNAVAILABLE, "decode-a")]
    status, headers, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == COMPLETION
    assert [list(r.exclude_worker_ids) for r in script.routes] == [[], ["decode-a"]]
    first, second = script.prefills
    assert second.request_id == f"{first.request_id}.1" and second.decode_worker_id == "decode-b"
    assert (headers["x-kvmesh-prefill-worker"], headers["x-kvmesh-decode-worker"]) == ("prefill-a", "decode-b")
    assert script.streams == [second.request_id]


async def test_retries_exhausted_is_a_429(mesh: Mesh, script: Script) -> None:
    script.prefill_failures = [(grpc.StatusCode.RESOURCE_EXHAUSTED, None)] * 3  # max_retries is 2
    status, headers, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 429 and headers["retry-after"] == "1"
    assert json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    # the third route finds every prefill worker excluded: the client hears the prefill's reason, not the route's
    assert [list(r.exclude_worker_ids) for r in script.routes] == [[], ["prefill-a"], ["prefill-a", "prefill-b"]]
    assert len(script.prefills) == 2


async def test_worker_rejection_is_a_400(mesh: Mesh, script: Script) -> None:
    script.prefill_failures = [(grpc.StatusCode.INVALID_ARGUMENT, None)]
    status, _, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400 and json.loads(raw)["error"]["message"] == "scripted failure"
    assert len(script.prefills) == 1


async def stream_whole_completion(mesh: Mesh) -> Mapping[str, str]:
    """A streamed chat that must end whole, with the script's completion, despite failures on the way: its headers."""
    status, headers, raw = await post(
        mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    )
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == COMPLETION
    return headers


async def test_error_after_the_stream_started_is_an_sse_frame(mesh: Mesh, script: Script) -> None:
    script.decode_error_after = 0  # every decode stream fails: the first attempt, then both migrations
    status, _, raw = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True})
    events = sse_events(raw)
    assert status == 200 and events[-1] != "[DONE]"
    assert events[-1]["error"]["code"] == "service_unavailable"
    assert events[-1]["error"]["type"] == "server_error"
    assert len(script.routes) == 3  # max_retries is 2


async def test_a_decode_failure_mid_stream_migrates_and_the_output_goes_on(mesh: Mesh, script: Script) -> None:
    script.decode_error_after, script.decode_errors = 1, 1
    headers = await stream_whole_completion(mesh)
    first_decode = headers["x-kvmesh-decode-worker"]
    # the second attempt: routed without the failed decode worker, with the first's prompt and, as its output so
    # far, the 3 tokens sent (prefill's, then decode's first batch of 2)
    assert [list(r.exclude_worker_ids) for r in script.routes] == [[], [first_decode]]
    assert script.prefills[1].prompt_token_ids == script.prefills[0].prompt_token_ids
    assert list(script.prefills[1].output_token_ids) == script.token_ids[:3]
    assert script.routes[1].num_prompt_tokens == script.routes[0].num_prompt_tokens + 3  # prefill computes them too
    assert script.prefills[1].request_id == script.prefills[0].request_id + ".m1"


async def test_with_late_binding_prefill_names_the_decode_worker_and_a_migration_avoids_it(
    mesh: Mesh, script: Script
) -> None:
    script.late_binding = True
    script.decode_error_after, script.decode_errors = 1, 1
    headers = await stream_whole_completion(mesh)
    first, second = script.prefills
    # no decode address: prefill bound decode-a (the header says so), then the migration's prefill avoided it
    assert (first.decode_address, list(first.exclude_decode_worker_ids)) == ("", [])
    assert (second.decode_address, list(second.exclude_decode_worker_ids)) == ("", ["decode-a"])
    assert headers["x-kvmesh-decode-worker"] == "decode-a"
    assert script.bound == {first.request_id: "decode-a", second.request_id: "decode-b"}
    assert script.streams == [first.request_id, second.request_id]


# a slow decode worker (mesh/latency_outliers.py, the gateway's default rule: 3x the pool's others', 8 samples)


@pytest.fixture
def view(mesh: Mesh) -> Iterator[MeshView]:
    """The gateway's mesh view, with no latency samples before or after the test (other tests' streams leave some,
    and an ejection would outlast the test)."""
    assert mesh.gateway.core is not None
    view = mesh.gateway.core.mesh
    for worker in ("decode-a", "decode-b"):
        view.latency.forget(worker)
    yield view
    for worker in ("decode-a", "decode-b"):
        view.latency.forget(worker)


async def report_gaps(view: MeshView, worker: str, gap_s: float) -> None:
    """Eight token gaps of `worker` over the last 4 s, as its streams would have reported them (a worker must be
    slow in both halves of the 5 s window): four dated back, then four now, the last 60 ms later, when the
    worker is judged again (at most every 50 ms)."""
    now_s = time.monotonic()
    for age_s in (4.0, 3.75, 3.5, 3.25):
        view.latency.record(MODEL, worker, gap_s, now_s - age_s)
    for _ in range(3):
        view.record_token_gap(MODEL, worker, gap_s, 1)
    await asyncio.sleep(0.06)
    view.record_token_gap(MODEL, worker, gap_s, 1)


def counted(metric: str, reason: str) -> float:
    return REGISTRY.get_sample_value(metric, {"reason": reason}) or 0.0


async def test_a_slow_decode_worker_is_left_out_of_the_routes(mesh: Mesh, script: Script, view: MeshView) -> None:
    ejections = counted("kvmesh_gateway_decode_ejections_total", "latency")
    await report_gaps(view, "decode-b", 0.01)
    await report_gaps(view, "decode-a", 0.2)  # 20x decode-b's
    assert counted("kvmesh_gateway_decode_ejections_total", "latency") == ejections + 1
    status, headers, _ = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert (status, headers["x-kvmesh-decode-worker"]) == (200, "decode-b")
    assert [list(r.exclude_worker_ids) for r in script.routes] == [["decode-a"]]
    # never the last: with decode-b excluded for a failure, the slow one is asked all the same
    script.prefill_failures = [(grpc.StatusCode.UNAVAILABLE, "decode-b")]
    status, headers, _ = await post(mesh, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert (status, headers["x-kvmesh-decode-worker"]) == (200, "decode-a")
    assert [list(r.exclude_worker_ids) for r in script.routes[1:]] == [["decode-a"], ["decode-b"]]


async def test_a_stream_on_a_decode_worker_found_slow_migrates_with_the_same_output(
    mesh: Mesh, script: Script, view: MeshView
) -> None:
    script.batch_size, script.decode_delays = 1, {"decode-a": 0.5}
    migrations = counted("kvmesh_gateway_migrations_total", "slow")
    await report_gaps(view, "decode-b", 0.01)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    request = asyncio.ensure_future(post(mesh, body))
    await wait_for(lambda: script.streams)  # following decode-a, whose next token is 0.5 s away
    await report_gaps(view, "decode-a", 0.5)  # its other streams show it slow: ejected
    status, headers, raw = await request
    events = sse_events(raw)
    assert (status, headers["x-kvmesh-decode-worker"], events[-1]) == (200, "decode-a", "[DONE]")
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == COMPLETION
    # moved after prefill's token only, without decode-a, which was told to drop the request (its KV freed)
    assert [list(r.exclude_worker_ids) for r in script.routes] == [[], ["decode-a"]]
    assert list(script.prefills[1].output_token_ids) == script.token_ids[:1]
    assert script.prefills[1].decode_worker_id == "decode-b"
    assert script.stream_ends == ["cancelled", "finished"]
    await wait_for(lambda: script.own_aborts())
    assert script.own_aborts() == [script.prefills[0].request_id]
    assert counted("kvmesh_gateway_migrations_total", "slow") == migrations + 1


async def test_a_push_to_a_decode_worker_found_slow_is_not_waited_for(
    mesh: Mesh, script: Script, view: MeshView
) -> None:
    """Prefill's push to decode-a takes 30 s (a stopped or starved worker): once decode-a is out of routing the
    request moves, with prefill's token, to decode-b; the push is cancelled and decode-a told to drop it."""
    script.push_delays = {"decode-a": 30.0}
    migrations = counted("kvmesh_gateway_migrations_total", "slow")
    await report_gaps(view, "decode-b", 0.01)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    request = asyncio.ensure_future(post(mesh, body))
    await wait_for(lambda: script.prefills)  # prefill answered and pushes to decode-a
    await report_gaps(view, "decode-a", 0.5)  # its other streams show it slow: ejected
    status, headers, raw = await asyncio.wait_for(request, 10)
    events = sse_events(raw)
    assert (status, headers["x-kvmesh-decode-worker"], events[-1]) == (200, "decode-a", "[DONE]")
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == COMPLETION
    first, second = script.prefills
    assert (list(second.output_token_ids), second.decode_worker_id) == (script.token_ids[:1], "decode-b")
    assert script.streams == [second.request_id]  # decode-a's stream was never opened
    await wait_for(lambda: len(script.pushes) == 2)
    assert sorted(script.pushes) == sorted([f"{first.request_id} cancelled", f"{second.request_id} finished"])
    await wait_for(lambda: script.own_aborts())
    assert script.own_aborts() == [first.request_id]
    assert counted("kvmesh_gateway_migrations_total", "slow") == migrations + 1
