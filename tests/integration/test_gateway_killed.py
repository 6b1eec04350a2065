"""A gateway SIGKILLed mid-stream still leaves exactly one usage record: its restart settles the request as
aborted, billed for the tokens the decode worker reported generating (services/gateway/tenancy/abandoned.py).
Real processes (`kvmesh up`'s launcher), real NATS JetStream, SQLite under a fresh state directory."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import signal
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from kvmesh.up import Mesh
from mesh import subjects
from mesh.pb import events_pb2

from .conftest import start_mesh, wait_until

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("gateway-killed")
    mesh = start_mesh(
        base / "mesh.log",
        prefill=1,
        decode=1,
        kvcache=0,
        encoder=0,
        models=(MODEL,),
        env_extra={"KVMESH_STATE_DIR": str(base / "state"), "KVMESH_SERVER_SECRET": "gateway-killed-test-secret"},
    )
    yield mesh
    mesh.stop()


def call(mesh: Mesh, method: str, path: str, key: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"{mesh.base_url}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


class FinishedFeed:
    """Every RequestFinished the decode workers publish, heard on NATS by the test itself."""

    def __init__(self, nats_url: str, tls: ssl.SSLContext | None) -> None:
        self.events: list[events_pb2.RequestFinished] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(nats_url, tls), self._loop).result(timeout=10)

    async def _listen(self, url: str, tls: ssl.SSLContext | None) -> None:
        self._client = await nats.connect(url, tls=tls, tls_handshake_first=tls is not None)

        async def heard(message: Any) -> None:
            event = events_pb2.RequestFinished()
            event.ParseFromString(message.data)
            self.events.append(event)

        await self._client.subscribe(subjects.REQUESTS_FINISHED, cb=heard)
        await self._client.flush()

    def of(self, request_id: str) -> list[events_pb2.RequestFinished]:
        return [e for e in list(self.events) if e.request_id == request_id or e.request_id.startswith(request_id + ".")]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def test_a_gateway_killed_mid_stream_leaves_one_aborted_record_billed_for_what_decode_emitted(mesh: Mesh) -> None:
    tenant = call(mesh, "POST", "/admin/v1/tenants", mesh.admin_key, {"name": "acme"})
    key = call(mesh, "POST", "/admin/v1/keys", mesh.admin_key, {"tenant": tenant["id"], "name": "ci"})["key"]
    feed = FinishedFeed(mesh.nats_url, mesh.nats_tls)
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count from one to one thousand, in words."}],
            "max_tokens": 2000,
            "ignore_eos": True,  # long enough to be killed mid-stream
            "temperature": 0,
            "stream": True,
        }
        request = urllib.request.Request(
            f"{mesh.base_url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        response = urllib.request.urlopen(request, timeout=60)
        request_id = response.headers["x-request-id"]
        num_chunks = 0
        while num_chunks < 4:  # a few tokens streamed: the request is mid-stream
            line = response.readline()
            assert line, "the stream ended before the gateway was killed"
            if line.startswith(b"data: {"):
                choices = json.loads(line.removeprefix(b"data: "))["choices"]
                num_chunks += bool(choices and choices[0]["delta"].get("content"))
        mesh.kill("gateway-0", signal.SIGKILL)
        response.close()
        wait_until(lambda: len(feed.of(request_id)) == 1, 30, "the decode worker to report the request aborted")
        (finished,) = feed.of(request_id)
        assert finished.finish_reason == "abort"
        assert finished.num_output_tokens >= num_chunks

        mesh.spawn("gateway", 0)  # the same worker id, another process
        mesh.wait_ready(timeout_s=120)
        today = dt.datetime.now(dt.UTC).date().isoformat()

        def records() -> list[dict[str, Any]]:
            usage = call(mesh, "GET", f"/admin/v1/usage?tenant={tenant['id']}&since={today}", mesh.admin_key)
            return [r for r in usage["records"] if r["request_id"] == request_id]

        wait_until(lambda: len(records()) > 0, 60, "the restarted gateway to settle the abandoned request")
        time.sleep(6)  # another sweep: it must not write a second record
        (record,) = records()
        assert (record["status"], record["http_status"], record["api"]) == ("aborted", 0, "chat.completions")
        assert record["completion_tokens"] == finished.num_output_tokens
        assert record["decode_worker"] == finished.worker_id == "decode-0"
        assert record["prompt_tokens"] > 0

        after = call(
            mesh,
            "POST",
            "/v1/chat/completions",
            key,
            {"model": MODEL, "messages": body["messages"], "max_tokens": 1, "temperature": 0},
        )
        assert record["prompt_tokens"] == after["usage"]["prompt_tokens"]  # the same prompt, counted by the server
    finally:
        feed.close()
