"""Late binding in a small mesh of real processes (one prefill, two decode, one balancer; no store, no encoder):
with KVMESH_BALANCER_DECODE_BINDING=late (the default) the balancer's Route names the prefill worker only, prefill
asks Balancer.BindDecode for a decode worker once the first token is sampled, and the gateway attaches where
prefill's first answer says; the binding is traced under prefill's span. The same greedy request then completes with
the exact tokens on a balancer that binds early (the balancer restarted with KVMESH_BALANCER_DECODE_BINDING=early).
"""

from __future__ import annotations

import signal
import time

import openai
import pytest

from kvmesh.bench.otlp_sink import OTLPSink

from .conftest import API_KEY, scrape, start_mesh, wait_child_ready
from .test_tracing import children, has_roles, one, traceparent

MODEL = "smollm2-135m"
PROMPT = "The three primary colours are"
BINDINGS = "kvmesh_balancer_decode_bindings_total"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, receiver: OTLPSink):
    log_path = tmp_path_factory.mktemp("late") / "mesh.log"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.grpc_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    mesh = start_mesh(log_path, env, prefill=1, decode=2, kvcache=0, balancer=1, encoder=0, models=(MODEL,))
    yield mesh
    mesh.stop()


def answer(client: openai.OpenAI, max_tokens: int, headers: dict[str, str] | None = None) -> tuple[str, list[str], int]:
    """The decode worker the gateway attached to, the output's tokens (greedy, logprobs' token strings), and the
    completion's token count."""
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    completion = raw.parse()
    assert completion.usage is not None and completion.choices[0].logprobs is not None
    return (
        raw.headers["x-kvmesh-decode-worker"],
        list(completion.choices[0].logprobs.tokens or []),
        completion.usage.completion_tokens,
    )


def test_late_binding_completes_with_the_tokens_of_early_binding(mesh, receiver: OTLPSink) -> None:
    client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=API_KEY, max_retries=0)
    late = mesh.child("balancer-0")
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    decode_worker, late_tokens, num_tokens = answer(client, 24, traceparent(trace_id, "20f067aa0ba902b9"))
    assert decode_worker in ("decode-0", "decode-1") and num_tokens == len(late_tokens) == 24
    assert scrape(late.http_port, BINDINGS) == {'{binding="late"}': 1.0}
    bind_call = ("kvmesh-balancer", "kvmesh.v1.Balancer/BindDecode")
    receiver.wait_for(has_roles(bind_call, ("kvmesh-decode", "kvmesh.v1.Decode/Stream")), trace_id, timeout_s=30)
    spans = receiver.spans(trace_id)
    (binding,) = children(spans, one(spans, "kvmesh-prefill", "kvmesh.v1.Prefill/PrefillStream"), "kvmesh.decode.bind")
    assert one(spans, *bind_call).parent_id == binding.span_id  # the traceparent went with the call
    assert binding.attributes["kvmesh.decode_worker_id"] == decode_worker
    assert binding.attributes["kvmesh.decode.bind_at"] == "admission"  # a short prompt: bound beside its compute
    assert one(spans, "kvmesh-decode", "kvmesh.v1.Decode/Stream").instance == decode_worker
    assert answer(client, 1)[1:] == (late_tokens[:1], 1)  # the first token ends it: nothing to bind
    assert scrape(late.http_port, BINDINGS) == {'{binding="late"}': 1.0}

    mesh.kill("balancer-0", signal.SIGTERM)  # leaves the pools with a `leaving` heartbeat
    early = mesh.spawn("balancer", 1, env={"KVMESH_BALANCER_DECODE_BINDING": "early"})
    wait_child_ready(early)
    time.sleep(1.5)  # three heartbeats: the gateway knows it, and it knows every worker
    decode_worker, early_tokens, num_tokens = answer(client, 24)
    assert decode_worker in ("decode-0", "decode-1") and num_tokens == 24
    assert early_tokens == late_tokens
    assert scrape(early.http_port, BINDINGS) == {'{binding="early"}': 1.0}
