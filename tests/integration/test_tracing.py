"""One trace per request across a real mesh (conftest.py's, shared with test_mesh.py) exporting to an OTLP
receiver inside the test: the client's
traceparent is honoured, and gateway, balancer, prefill (its store read, compute and push), kvcache and decode
spans hang off each other as the request travelled, for a streamed chat and for one migrated after a decode kill.
Prompts and outputs never enter a span; the gateway's log lines carry the trace's ids."""

from __future__ import annotations

import json
import signal
import time

import openai
import pytest

from kvmesh.bench.otlp_sink import ReceivedSpan

from .conftest import API_KEY, wait_until

MODEL = "smollm2-135m"
DOCUMENT = " ".join(f"Entry {i}: the {i}th lighthouse of the northern coast is painted green." for i in range(12))
ROLES = ("kvmesh-gateway", "kvmesh-balancer", "kvmesh-prefill", "kvmesh-kvcache", "kvmesh-decode")


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def traceparent(trace_id: str, span_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{span_id}-01"}


def one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{service} {name}: {len(found)} spans in {sorted((s.service, s.name) for s in spans)}"
    return found[0]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_id == parent.span_id and s.name == name]


def has_roles(*names: tuple[str, str]):
    return lambda spans: all(any((s.service, s.name) == name for s in spans) for name in names)


def assert_no_text(spans: list[ReceivedSpan], *texts: str) -> None:
    """No attribute of any span holds a prompt's or an output's words."""
    values = json.dumps([s.attributes for s in spans])
    for text in texts:
        for words in (text[:24], text[-24:]):
            if len(words.strip()) >= 8:
                assert words not in values


def test_a_streamed_chat_is_one_trace_from_the_clients_span_to_decode(mesh, client, receiver):
    # the prompt's blocks reach the store from one prefill worker, which then leaves: the traced request is
    # prefilled by the other one, reading the prefix from the kvcache node
    warm = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": DOCUMENT}], max_tokens=2, temperature=0
    )
    mesh.kill(warm.headers["x-kvmesh-prefill-worker"], signal.SIGTERM)
    time.sleep(3)  # it drained, flushed its store writes and left the pools
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    pieces, usage = [], None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": DOCUMENT}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=traceparent(trace_id, client_span),
    )
    for chunk in stream:
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    receiver.wait_for(
        has_roles(
            ("kvmesh-gateway", f"chat {MODEL}"),
            ("kvmesh-decode", "kvmesh.v1.Decode/Stream"),
            ("kvmesh-kvcache", "kvmesh.v1.KVCache/Get"),
            ("kvmesh-decode", "kvmesh.v1.Decode/PushKV"),
        ),
        trace_id,
        timeout_s=30,
    )
    spans = receiver.spans(trace_id)
    assert {s.service for s in spans} >= set(ROLES)

    root = one(spans, "kvmesh-gateway", f"chat {MODEL}")
    assert (root.parent_id, root.kind) == (client_span, "SERVER")
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 8
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["kvmesh.cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert root.attributes["http.response.status_code"] == 200

    route = one(spans, "kvmesh-balancer", "kvmesh.v1.Balancer/Route")
    prefill = one(spans, "kvmesh-prefill", "kvmesh.v1.Prefill/PrefillStream")
    stream_span = one(spans, "kvmesh-decode", "kvmesh.v1.Decode/Stream")
    assert route.parent_id == prefill.parent_id == stream_span.parent_id == root.span_id
    assert prefill.instance == root.attributes["kvmesh.prefill_worker_id"] != warm.headers["x-kvmesh-prefill-worker"]
    assert stream_span.instance == root.attributes["kvmesh.decode_worker_id"]
    assert prefill.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert prefill.attributes["kvmesh.cached_tokens.store"] > 0
    assert "first token" in stream_span.events
    assert stream_span.attributes["gen_ai.response.finish_reasons"] == ["length"]

    (device_read,) = children(spans, prefill, "kvmesh.kv.read device")
    (compute,) = children(spans, prefill, "kvmesh.prefill.compute")
    # a layer-major read feeds the compute while it runs (its child); a whole-block read comes before it
    (store_read,) = children(spans, prefill, "kvmesh.kv.read store") + children(spans, compute, "kvmesh.kv.read store")
    (push,) = children(spans, prefill, "kvmesh.kv.push")
    # this worker never saw the prompt: at most the chat template's first block, which the mesh's earlier requests
    # (test_mesh.py's) share, is on its device
    assert device_read.attributes["kvmesh.kv.num_blocks"] <= 1
    get = one(spans, "kvmesh-kvcache", "kvmesh.v1.KVCache/Get")
    assert get.parent_id == store_read.span_id
    assert sum(v for k, v in get.attributes.items() if k.startswith("kvmesh.kv.num_blocks.")) > 0
    assert compute.attributes["kvmesh.num_computed_tokens"] < usage.prompt_tokens
    push_kv = one(spans, "kvmesh-decode", "kvmesh.v1.Decode/PushKV")
    assert push_kv.parent_id == push.span_id
    assert push_kv.attributes["kvmesh.kv.bytes"] == push.attributes["kvmesh.kv.bytes"] > 0
    assert all(s.trace_id == trace_id for s in spans)
    assert_no_text(spans, DOCUMENT, "".join(pieces))

    lines = (line.partition(" | ")[2] for line in mesh.log_path.read_text().splitlines())  # "  gateway-0 | {...}"
    logged = [json.loads(line) for line in lines if line.startswith("{")]
    finished = [line for line in logged if line.get("event") == "request finished" and line.get("trace_id") == trace_id]
    assert [line["span_id"] for line in finished] == [root.span_id]


def test_a_request_migrated_after_a_decode_kill_stays_one_trace(mesh, client, receiver):
    trace_id, client_span = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to fifty, in words."}],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    with client.chat.completions.with_streaming_response.create(
        stream=True, extra_headers=traceparent(trace_id, client_span), **request
    ) as response:
        killed = response.headers["x-kvmesh-decode-worker"]
        for number, _ in enumerate(response.parse()):
            if number == 4:
                mesh.kill(killed, signal.SIGKILL)
    receiver.wait_for(
        has_roles(("kvmesh-gateway", f"chat {MODEL}"), ("kvmesh-gateway", "kvmesh.migrate")), trace_id, 30
    )
    wait_until(lambda: len(receiver.spans(trace_id)) >= 8, 10, "the survivors' spans")
    time.sleep(1)  # the last batch of every survivor
    spans = receiver.spans(trace_id)
    root = one(spans, "kvmesh-gateway", f"chat {MODEL}")
    migrate = one(spans, "kvmesh-gateway", "kvmesh.migrate")
    assert root.parent_id == client_span and migrate.parent_id == root.span_id
    assert migrate.attributes["kvmesh.failed_worker_id"] == killed
    assert root.attributes["kvmesh.num_migrations"] == 1
    assert root.attributes["gen_ai.usage.output_tokens"] == 40
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]

    # before the kill: routed and prefilled under the request's span; after: under the migration's
    prefills = [s for s in spans if s.name == "kvmesh.v1.Prefill/PrefillStream"]
    routes = [s for s in spans if s.name == "kvmesh.v1.Balancer/Route"]
    assert sorted(s.parent_id for s in prefills) == sorted(s.parent_id for s in routes)
    assert sorted(s.parent_id for s in prefills) == sorted([root.span_id, migrate.span_id])
    survivor = [s for s in spans if s.name == "kvmesh.v1.Decode/Stream" and s.instance != killed]
    assert len(survivor) == 1 and survivor[0].parent_id == root.span_id
    assert survivor[0].attributes["gen_ai.response.finish_reasons"] == ["length"]
    resumed = next(s for s in prefills if s.parent_id == migrate.span_id)
    (push,) = children(spans, resumed, "kvmesh.kv.push")
    assert push.attributes["kvmesh.decode_worker_id"] == survivor[0].instance
    assert {s.service for s in spans} >= {"kvmesh-gateway", "kvmesh-balancer", "kvmesh-prefill", "kvmesh-decode"}
