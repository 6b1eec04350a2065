"""The mesh end to end: the official openai SDK against the gateway, over real prefill, decode, kvcache and
balancer processes. Tests run in order against one module-scoped mesh; the fault tests come last."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.deploy.promql import PROMETHEUS_OWN, expressions, family, metric_names

from .conftest import API_KEY, scrape, total, wait_child_ready, wait_until

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, content: str, max_tokens: int = 12, **kwargs):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0, **kwargs
    )
    return raw.parse(), raw.headers


def test_the_sdk_completes_a_chat(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    completion = raw.parse()
    assert completion.choices[0].message.content == "The capital of France is Paris."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == 37
    assert completion.usage.prompt_tokens_details.cached_tokens in (0, 32)
    assert raw.headers["x-request-id"]
    assert raw.headers["x-kvmesh-prefill-worker"].startswith("prefill-")
    assert raw.headers["x-kvmesh-decode-worker"].startswith("decode-")


def test_the_sdk_streams_a_chat_with_exactly_one_usage_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens == 8
    plain = list(
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, stream=True)
    )
    assert all(c.usage is None for c in plain)


def test_both_replicas_of_each_pool_serve_traffic(client):
    """Every prompt shares the chat template's first 32 tokens, so the router's cache affinity pulls them to one
    prefill and only load spreads them: how soon it does depends on the machine's speed. Up to four rounds of 12
    concurrent requests, stopping once every replica has served one; a replica the balancer never picks fails."""
    prefills: set[str] = set()
    decodes: set[str] = set()
    for round_ in range(4):
        prompts = [f"Write one sentence about the number {round_ * 12 + n}." for n in range(12)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda p: chat(client, p, max_tokens=4), prompts))
        prefills |= {headers["x-kvmesh-prefill-worker"] for _, headers in results}
        decodes |= {headers["x-kvmesh-decode-worker"] for _, headers in results}
        if len(prefills) == len(decodes) == 2:
            break
    assert prefills == {"prefill-0", "prefill-1"}
    assert decodes == {"decode-0", "decode-1"}


def test_decode_never_computes_a_prompt_it_was_sent(mesh, client):
    chat(client, "Name a colour.", max_tokens=4)
    for name in ("decode-0", "decode-1"):
        port = mesh.child(name).http_port
        assert total(port, "kvmesh_decode_prompt_tokens_computed") == 0
    moved = sum(total(mesh.child(f"prefill-{i}").http_port, "kvmesh_kv_transfer_bytes_total") for i in range(2))
    assert moved > 0


def test_bad_input_gets_an_openai_error_never_a_500(mesh, client):
    def post(body: bytes, key: str = API_KEY) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"{mesh.base_url}/v1/chat/completions",
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    status, body = post(b"{not json")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post(json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": "ten"}).encode())
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = post(json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": -3}).encode())
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = post(json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 10**9}).encode())
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = post(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 9000}]}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post(json.dumps({"model": "gpt-17", "messages": QUESTION}).encode())
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = post(json.dumps({"model": MODEL, "messages": QUESTION}).encode(), key="sk-wrong")
    assert status == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="nope", max_retries=0).models.list()
    # the mesh carries on
    assert chat(client, "Say yes.", max_tokens=2)[0].choices[0].message.content


def test_every_metric_a_dashboard_panel_or_alert_reads_is_served_by_the_mesh(mesh):
    """deploy/grafana and deploy/prometheus read only series a live mesh serves (by family: a histogram's
    `_bucket` is its family's), scraped from every process, the gateway with the admin key."""
    families: set[str] = set()
    for child in mesh.children:
        request = urllib.request.Request(
            f"http://127.0.0.1:{child.http_port}/metrics", headers={"Authorization": f"Bearer {mesh.admin_key}"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            text = response.read().decode()
        families.update(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))
    assert {child.role for child in mesh.children} >= {"gateway", "prefill", "decode", "kvcache", "balancer"}
    missing = {
        where: sorted(
            name for name in metric_names(expr) if family(name, families) is None and name not in PROMETHEUS_OWN
        )
        for where, expr in expressions().items()
    }
    assert {where: names for where, names in missing.items() if names} == {}


def test_a_client_that_disconnects_mid_stream_frees_its_kv(mesh, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}, temperature=1.0
    )
    next(iter(stream))
    next(iter(stream))
    stream.close()

    def idle() -> bool:
        return all(total(mesh.child(f"decode-{i}").http_port, "kvmesh_decode_running_requests") == 0 for i in range(2))

    wait_until(idle, 30, "decode workers to drop the abandoned request")


def test_a_killed_balancer_is_failed_over_within_each_request(mesh, client):
    """The gateway still lists balancer-0 for three heartbeats after its SIGKILL; a request that asks it first
    asks balancer-1 next, within the same request: none fails."""
    mesh.kill("balancer-0", signal.SIGKILL)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: chat(client, f"Count to {n}.", max_tokens=2), range(8)))
    assert all(r.choices[0].message.content for r, _ in results)
    with open(mesh.out.name) as log:  # type: ignore[attr-defined]  # the mesh's log file
        failed = [line for line in log if "gateway-0 |" in line and '"route failed"' in line]
    assert failed and all('"balancer": "balancer-0"' in line and '"UNAVAILABLE"' in line for line in failed)
    child = mesh.restart(mesh.child("balancer-0"))  # back to two balancers, as the supervisor would
    wait_child_ready(child)


def test_a_prefix_computed_on_one_prefill_worker_is_reused_by_the_other_through_the_store(mesh, client):
    document = " ".join(f"Fact {i}: the {i}th planet of a far away system is made of cheese." for i in range(12))
    first, headers = chat(client, document + " Which planet is made of cheese?", max_tokens=2)
    served_by = headers["x-kvmesh-prefill-worker"]
    other = "prefill-1" if served_by == "prefill-0" else "prefill-0"
    mesh.kill(served_by, signal.SIGTERM)  # leaves the pool gracefully; its device cache goes with it
    second, headers = chat(client, document + " Which planet is made of cheese?", max_tokens=2)
    assert headers["x-kvmesh-prefill-worker"] == other
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * (first.usage.prompt_tokens // 16 - 1)
    assert (
        scrape(mesh.child(other).http_port, "kvmesh_prefill_cached_tokens_total").get(
            f'{{model="{MODEL}",tier="store"}}', 0
        )
        > 0
    )
    mesh.spawn("prefill", int(served_by[-1]))  # back to two workers


def test_a_decode_worker_killed_mid_stream_is_migrated_around_and_the_output_is_unchanged(mesh, client):
    # sampled, seeded, with penalties: the new pair's engine continues the generation itself (same draws by
    # output position, penalties counting the output sent), so the text is the uninterrupted run's
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to fifty, in words."}],
        max_tokens=40,
        temperature=0.8,
        seed=11,
        presence_penalty=0.5,
        extra_body={"ignore_eos": True},
    )
    expected = client.chat.completions.create(**request).choices[0].message.content
    pieces = []
    with client.chat.completions.with_streaming_response.create(stream=True, **request) as response:
        serving = response.headers["x-kvmesh-decode-worker"]
        for number, chunk in enumerate(response.parse()):
            pieces.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            if number == 4:
                mesh.kill(serving, signal.SIGKILL)
    assert "".join(pieces) == expected
    child = mesh.spawn("decode", int(serving[-1]))  # back to two workers for the tests after this one
    wait_child_ready(child)
    time.sleep(3)  # its heartbeats reach the balancer


def test_a_killed_decode_worker_leaves_the_pool_and_new_requests_still_succeed(mesh, client):
    mesh.kill("decode-1", signal.SIGKILL)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: chat(client, f"Count to {n}.", max_tokens=3), range(8)))
    assert all(r.choices[0].message.content for r, _ in results)
    assert {h["x-kvmesh-decode-worker"] for _, h in results} == {"decode-0"}
    child = mesh.spawn("decode", 1)  # back to two workers for test_tracing.py, on this mesh next
    wait_child_ready(child)
    time.sleep(3)  # its heartbeats reach the balancers
