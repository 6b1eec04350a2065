"""The mesh as `docker compose up` runs it: the image built from this tree, every role in its own container,
the official openai SDK against the published gateway. Tests run in order against one stack (deepseek-tiny
only): chats, then prefill and decode scaled to 2, then a decode container killed mid-run and started again.

Skips, saying why, where no Docker engine (with the Compose v2 plugin) is reachable, or where
KVMESH_SKIP_CONTAINER_TESTS gives a reason (.ci/run sets it when it could not start one)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import threading
import time

import pytest


def _why_not_docker() -> str | None:
    if os.environ.get("KVMESH_SKIP_CONTAINER_TESTS"):
        return os.environ["KVMESH_SKIP_CONTAINER_TESTS"]
    try:
        import docker

        docker.from_env(timeout=10).ping()
    except Exception as exc:  # no SDK, no socket, no daemon: all mean the same here
        return f"no Docker engine reachable: {type(exc).__name__}: {exc}"
    try:
        subprocess.run(["docker", "compose", "version"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no Docker Compose v2 plugin: {exc}"
    return None


_reason = _why_not_docker()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

import openai  # noqa: E402

from .stack import API_KEY, Stack  # noqa: E402

MODEL = "deepseek-tiny"
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as env:
        for name in [n for n in os.environ if n.startswith(("KVMESH_", "COMPOSE_"))]:
            env.delenv(name)  # the shell's would override the stack's env file (compose: shell first)
        stack = Stack(tmp_path_factory.mktemp("compose"))
        try:
            stack.up(timeout_s=600)
            yield stack
        finally:
            print(f"compose stack logs: {stack.save_logs()}")  # shown in a failed test's report
            stack.down()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, content: str, max_tokens: int = 8):
    """Greedy, exactly max_tokens tokens (deepseek-tiny's random weights may say EOS at any point)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return raw.parse(), raw.headers


def host_of(worker_id: str, role: str) -> str:
    """The container hostname inside a default worker id, `<role>-<hostname>-<pid>`."""
    assert worker_id.startswith(f"{role}-"), worker_id
    return worker_id.removeprefix(f"{role}-").rsplit("-", 1)[0]


def hostnames(stack, service: str) -> set[str]:
    return {stack.container(c).attrs["Config"]["Hostname"] for c in stack.running(service)}


def test_the_sdk_completes_a_chat_and_only_the_configured_model_is_served(stack, client):
    assert [m.id for m in client.models.list().data] == [MODEL]  # KVMESH_MODELS passed through from the host
    completion, headers = chat(client, "What is the capital of France?")
    again, _ = chat(client, "What is the capital of France?")
    assert completion.choices[0].message.content and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    assert again.choices[0].message.content == completion.choices[0].message.content  # greedy: the same
    assert host_of(headers["x-kvmesh-prefill-worker"], "prefill") in hostnames(stack, "prefill")
    assert host_of(headers["x-kvmesh-decode-worker"], "decode") in hostnames(stack, "decode")


def test_the_sdk_streams_a_chat_with_exactly_one_usage_chunk(client):
    expected, _ = chat(client, "Name three colours.")
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.choices[0].message.content
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0] is chunks[-1] and usage[0].usage.completion_tokens == 8


def test_workers_announce_their_container_address(stack):
    for service in ("prefill", "decode", "kvcache", "balancer"):
        for compose_container in stack.running(service):
            container = stack.container(compose_container)
            ip = next(iter(container.attrs["NetworkSettings"]["Networks"].values()))["IPAddress"]
            serving = [
                json.loads(line)
                for line in container.logs().decode().splitlines()
                if line.startswith("{") and '"serving"' in line
            ]
            assert serving and re.fullmatch(rf"{re.escape(ip)}:[1-9]\d*", serving[-1]["grpc"]), service


def test_both_replicas_of_each_scaled_pool_serve_traffic(stack, client):
    stack.scale(timeout_s=300, prefill=2, decode=2)
    prefill_hosts, decode_hosts = hostnames(stack, "prefill"), hostnames(stack, "decode")
    assert len(prefill_hosts) == 2 and len(decode_hosts) == 2
    time.sleep(2.0)  # four heartbeats: the new workers are in the balancer's pools
    seen_prefill: set[str] = set()
    seen_decode: set[str] = set()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for batch in range(3):  # routing is by load: a few concurrent batches reach every replica
            prompts = [f"Write one sentence about the number {batch * 12 + n}." for n in range(12)]
            for _, headers in pool.map(lambda p: chat(client, p, max_tokens=4), prompts):
                seen_prefill.add(host_of(headers["x-kvmesh-prefill-worker"], "prefill"))
                seen_decode.add(host_of(headers["x-kvmesh-decode-worker"], "decode"))
            if seen_prefill == prefill_hosts and seen_decode == decode_hosts:
                break
    assert seen_prefill == prefill_hosts
    assert seen_decode == decode_hosts


class RequestRun:
    """Chats sent back to back from a few threads until stopped: (start time, decode host or None, error)."""

    def __init__(self, client, num_threads: int = 3) -> None:
        self.client = client
        self.results: list[tuple[float, str | None, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(num_threads)]

    def __enter__(self) -> RequestRun:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def _loop(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                _, headers = chat(self.client, f"Thread {index}, request {n}: count to ten.", max_tokens=6)
                # empty when the request migrated and its new prefill worker made the last token: no decode
                decode_worker = headers["x-kvmesh-decode-worker"]
                self.results.append((started, host_of(decode_worker, "decode") if decode_worker else "", ""))
            except openai.APIError as exc:
                self.results.append((started, None, f"{type(exc).__name__}: {exc}"))
            n += 1

    def wait_for(self, count: int, since: float, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(1 for started, _, _ in self.results if started > since) < count:
            assert time.monotonic() < deadline, f"fewer than {count} requests finished in {timeout_s:.0f}s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def killed_decode(stack) -> dict:
    """Filled by the kill test: the decode container it killed, for the rejoin test."""
    return {}


def test_a_killed_decode_container_leaves_its_pool_and_new_requests_still_succeed(stack, client, killed_decode):
    victim, survivor = stack.running("decode")
    victim_host = stack.container(victim).attrs["Config"]["Hostname"]
    survivor_host = stack.container(survivor).attrs["Config"]["Hostname"]
    with RequestRun(client) as run:
        run.wait_for(6, since=0.0, timeout_s=120)
        killed_at = time.monotonic()
        stack.container(victim).kill()  # SIGKILL: a crash, no goodbye on the bus
        killed_decode.update(container=victim, host=victim_host)
        run.wait_for(12, since=killed_at, timeout_s=180)
    # requests in flight on the victim when it died may fail; every one sent after the kill must succeed
    after = [
        (round(started - killed_at, 2), host, error) for started, host, error in run.results if started > killed_at
    ]
    assert [r for r in after if r[2]] == []
    assert {host for _, host, _ in after} == {survivor_host}, after
    assert stack.container(victim).status == "exited"  # a kill is a manual stop: no restart policy brought it back


def test_the_killed_decode_container_rejoins_when_started_again(stack, client, killed_decode):
    assert killed_decode, "runs after the kill test"
    stack.container(killed_decode["container"]).start()
    stack.wait_healthy({"nats": 1, "gateway": 1, "prefill": 2, "decode": 2, "kvcache": 1, "balancer": 2}, timeout_s=300)
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        while killed_decode["host"] not in seen and time.monotonic() < deadline:
            prompts = [f"Say a word that rhymes with {word}." for word in ("cat", "dog", "sun", "tree", "sky", "sea")]
            seen |= {
                host_of(h["x-kvmesh-decode-worker"], "decode")
                for _, h in pool.map(lambda p: chat(client, p, 4), prompts)
            }
    assert killed_decode["host"] in seen
