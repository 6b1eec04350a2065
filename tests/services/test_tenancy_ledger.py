"""The usage ledger loses nothing and counts nothing twice: requests through a gateway (the scripted workers of
gateway_harness) end in exactly one usage_records row each, with the tokens the client saw, through a real NATS
JetStream and a real database (SQLite, and PostgreSQL where one answers), while NATS and the consumer are killed.

LEDGER_REQUESTS (env) sets the size of the run that kills NATS twice and the consumer once (docs/tenancy.md has
the 10,000-request run's figures)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import io
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import grpc.aio
import pytest
from sqlalchemy import func, select

from engine_core import model_store
from kvmesh.cli import main
from kvmesh.nats_server import EmbeddedNats
from mesh.bus import Bus
from mesh.config import load_settings
from mesh.discovery import Announcer
from mesh.logging import REQUEST_ID_KEY
from mesh.pb import common_pb2, events_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.catalog import ModelCatalog, ServedModel, load_model
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer
from services.gateway.tenancy import schema
from services.gateway.tenancy.db import Database, open_database
from services.gateway.tenancy.ledger import (
    LINGER_S,
    MSG_ID_HEADER,
    LedgerConsumer,
    UsagePublisher,
    ensure_usage_stream,
)

from .gateway_harness import COMPLETION, DECODES, KEY, MODEL, PREFILLS, Fakes, Script, wait_for_ready
from .tenancy_databases import BACKENDS, empty_database_url

ADMIN_KEY = "sk-admin-ledger-test"
HEARTBEAT_S = 2.0  # a NATS outage shorter than three of these keeps the workers in the gateway's view
NATS_DOWN_S = 2.5  # longer than the publisher's ack timeout (2 s): publishes fail and are retried
NUM_SOAK_REQUESTS = int(os.environ.get("LEDGER_REQUESTS", "120"))


@dataclass
class Seen:
    """What one client saw: the request id and the usage in its answer (zeros for a refusal)."""

    request_id: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class LedgerMesh:
    nats: EmbeddedNats
    fakes: Fakes
    gateway: GatewayServer
    database: Database
    consumer_bus: Bus
    consumer: LedgerConsumer
    base_url: str
    model: ServedModel

    async def restart_nats(self, down_s: float = NATS_DOWN_S) -> None:
        """SIGKILL the NATS server, then start it again on its port and store (its JetStream streams survive)."""
        assert self.nats.process is not None
        self.nats.process.kill()
        self.nats.process.wait()
        await asyncio.sleep(down_s)
        self.nats = EmbeddedNats(port=self.nats.port, store_dir=self.nats.store_dir).start()

    def consumers(self) -> list[LedgerConsumer]:
        """The gateway's and this test's: two replicas' share of the one durable consumer."""
        return [self.consumer] + ([self.gateway.ledger_consumer] if self.gateway.ledger_consumer else [])

    async def restart_consumer(self) -> None:
        """Kill the test's consumer (no grace: a batch it holds unacked is redelivered), start a new one."""
        await self.consumer.stop(grace_s=0)
        self.consumer = LedgerConsumer(self.consumer_bus, self.database, ack_wait_s=2.0)
        await self.consumer.start()

    async def num_rows(self) -> int:
        async with self.database.engine.connect() as connection:
            return int((await connection.execute(select(func.count()).select_from(schema.usage_records))).scalar_one())

    async def rows(self) -> dict[str, Any]:
        async with self.database.engine.connect() as connection:
            result = await connection.execute(select(schema.usage_records))
            return {row.request_id: row for row in result}

    async def wait_for_rows(self, count: int, timeout_s: float = 30.0) -> None:
        """Until `count` rows are written, then a while longer (past a consumer's linger): a late duplicate would show
        as a row too many."""
        deadline = time.monotonic() + timeout_s
        while await self.num_rows() < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(LINGER_S + 0.5)


@pytest.fixture(scope="module")
def served_model() -> ServedModel:
    model = load_model(str(model_store.ensure(MODEL)))
    return ServedModel(MODEL, model.tokenizer, model.context_len)


@contextlib.asynccontextmanager
async def ledger_mesh(backend: str, tmp_path: Path, model: ServedModel) -> AsyncIterator[LedgerMesh]:
    async with empty_database_url(backend, tmp_path) as url:
        nats = EmbeddedNats(store_dir=tmp_path / "nats").start()
        fakes = Fakes()
        fakes.script = Script(token_ids=model.tokenizer.encode(COMPLETION, add_special_tokens=False))
        server = await fakes.serve()
        settings = load_settings(
            GatewaySettings,
            env={},
            nats_url=nats.url,
            http_port=0,
            grpc_port=0,
            api_keys=(KEY,),
            models=(MODEL,),
            heartbeat_interval_s=HEARTBEAT_S,
            log_level="warning",
            database_url=url,
            state_dir=str(tmp_path / "state"),
            admin_key=ADMIN_KEY,
        )
        database = await open_database(settings)
        workers_bus = await Bus.connect(nats.url, name="fake-workers")
        workers = [(w, common_pb2.ROLE_PREFILL) for w in PREFILLS] + [(w, common_pb2.ROLE_DECODE) for w in DECODES]
        announcers = [
            Announcer(workers_bus, fakes.info(w, role), common_pb2.WorkerLoad, HEARTBEAT_S)
            for w, role in [("balancer-0", common_pb2.ROLE_BALANCER), *workers]
        ]
        consumer_bus = await Bus.connect(nats.url, name="ledger")
        consumer = LedgerConsumer(consumer_bus, database, ack_wait_s=2.0)  # first: it creates the durable consumer
        await consumer.start()
        gateway = GatewayServer(settings, catalog=ModelCatalog([model]))
        await gateway.start()
        for announcer in announcers:
            await announcer.start()
        mesh = LedgerMesh(
            nats, fakes, gateway, database, consumer_bus, consumer, f"http://127.0.0.1:{gateway.http_port}", model
        )
        try:
            await wait_for_ready(mesh.base_url)
            yield mesh
        finally:
            for announcer in announcers:
                await announcer.stop()
            await gateway.stop()
            await mesh.consumer.stop()
            await consumer_bus.close()
            await workers_bus.close()
            await server.stop(grace=None)
            await database.close()
            mesh.nats.stop()


async def chat(session: aiohttp.ClientSession, mesh: LedgerMesh, index: int) -> Seen:
    """One request of a mix: streamed or not, and every tenth one refused (a bad field) after its key passed."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi " + "there " * (index % 7)}],
        "max_tokens": 1 + index % 5,
    }
    if index % 10 == 9:
        body["temperature"] = -1  # a 400 naming the field
    stream = index % 2 == 1
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with session.post(f"{mesh.base_url}/v1/chat/completions", json=body, headers=headers) as response:
        raw = await response.read()
        request_id = response.headers["x-request-id"]
        if response.status != 200:
            return Seen(request_id, response.status, 0, 0, 0)
    if stream:
        usage = json.loads(raw.decode().split("\n\n")[-3].removeprefix("data: "))["usage"]
    else:
        usage = json.loads(raw)["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return Seen(request_id, 200, usage["prompt_tokens"], cached, usage["completion_tokens"])


async def run_requests(mesh: LedgerMesh, count: int, concurrency: int = 16) -> list[Seen]:
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(index: int) -> Seen:
            async with limit:
                return await chat(session, mesh, index)

        return list(await asyncio.gather(*(one(index) for index in range(count))))


async def assert_ledger_matches(mesh: LedgerMesh, seen: list[Seen]) -> None:
    await mesh.wait_for_rows(len(seen))
    rows = await mesh.rows()
    assert len(rows) == len(seen) == len({s.request_id for s in seen})
    for s in seen:
        row = rows[s.request_id]
        assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
            s.prompt_tokens,
            s.cached_tokens,
            s.completion_tokens,
        ), s
        assert row.http_status == s.status
        assert row.status == ("finished" if s.status == 200 else "refused")
        assert (row.tenant_id, row.key_id, row.api) == ("default", "key_env_0", "chat.completions")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_every_request_gives_one_record_with_the_tokens_the_client_saw(
    backend: str, tmp_path: Path, served_model: ServedModel
) -> None:
    async with ledger_mesh(backend, tmp_path, served_model) as mesh:
        seen = await run_requests(mesh, 30)
        assert [s.status for s in seen].count(400) == 3
        await assert_ledger_matches(mesh, seen)
        rows = await mesh.rows()
        served = rows[seen[0].request_id]
        assert served.model == MODEL and served.prefill_worker == "prefill-a" and served.decode_worker == "decode-a"
        assert served.price_plan == "default" and served.cost == Decimal(0)  # no price row: free, plan as is
        assert served.ttft_ms is not None and 0 < served.ttft_ms <= served.e2e_ms
        refused = rows[seen[9].request_id]
        assert (refused.model, refused.prefill_worker, refused.ttft_ms) == (
            "unknown",
            None,
            None,
        )  # refused before its model was read
        assert mesh.gateway.ledger is not None and mesh.gateway.ledger.num_dropped == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_usage_report_through_the_admin_api_and_the_cli(
    backend: str, tmp_path: Path, served_model: ServedModel
) -> None:
    async with ledger_mesh(backend, tmp_path, served_model) as mesh:
        seen = await run_requests(mesh, 20)
        await mesh.wait_for_rows(20)
        today = dt.datetime.now(dt.UTC).date()
        query = f"tenant=default&since={today - dt.timedelta(days=1)}&until={today + dt.timedelta(days=1)}"
        async with aiohttp.ClientSession() as session:
            url = f"{mesh.base_url}/admin/v1/usage?{query}"
            async with session.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as response:
                assert response.status == 200
                report = await response.json()
            async with session.get(url, headers={"Authorization": f"Bearer {KEY}"}) as response:
                assert response.status == 403  # a tenant's key never reads the ledger
            bad = f"{mesh.base_url}/admin/v1/usage?tenant=default&since=12/01/2026"
            async with session.get(bad, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as response:
                assert (response.status, (await response.json())["error"]["param"]) == (400, "since")
        totals = report["totals"]
        assert {t["model"] for t in totals} == {MODEL, "unknown"}  # "unknown": refused before the model was read
        assert report["num_requests"] == sum(t["num_requests"] for t in totals) == 20
        assert sum(t["prompt_tokens"] for t in totals) == sum(s.prompt_tokens for s in seen)
        assert sum(t["completion_tokens"] for t in totals) == sum(s.completion_tokens for s in seen)
        assert sorted(r["request_id"] for r in report["records"]) == sorted(s.request_id for s in seen)
        argv = ["admin", "--url", mesh.base_url, "--admin-key", ADMIN_KEY, "usage", "--tenant", "default"]
        argv += ["--since", str(today - dt.timedelta(days=1)), "--until", str(today + dt.timedelta(days=1))]

        def cli() -> tuple[int, str]:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                return main([*argv, "--format", "csv"]), out.getvalue()

        lines = [",".join(str(t[name]) for name in t) for t in totals]
        assert await asyncio.to_thread(cli) == (0, "\n".join([",".join(totals[0]), *lines, ""]))


async def test_a_client_that_leaves_and_a_grpc_call_each_leave_one_record(
    tmp_path: Path, served_model: ServedModel
) -> None:
    async with ledger_mesh("sqlite", tmp_path, served_model) as mesh:
        mesh.fakes.script.batch_delay_s = 0.2  # 1 token from prefill, then 2 per batch: time to leave mid-stream
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "stream": True}
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {KEY}"}
            async with session.post(f"{mesh.base_url}/v1/chat/completions", json=body, headers=headers) as response:
                gone_id = response.headers["x-request-id"]
                await response.content.readuntil(b"\n\n")  # the role chunk: then the client leaves
        mesh.fakes.script.batch_delay_s = 0.0
        grpc_id = "grpc-ledger-1"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh.gateway.grpc_port}") as channel:
            request = gateway_pb2.GenerateRequest(model=MODEL, prompt="Hi", sampling=common_pb2.SamplingParams())
            metadata = (("authorization", f"Bearer {KEY}"), (REQUEST_ID_KEY, grpc_id))
            responses = [r async for r in gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=metadata)]
        await mesh.wait_for_rows(2)
        rows = await mesh.rows()
        assert len(rows) == 2
        gone = rows[gone_id]
        assert (gone.status, gone.http_status, gone.api) == ("client_gone", 499, "chat.completions")
        num_completion = len(mesh.fakes.script.token_ids)
        # billed for what it was sent: prefill's first token; its disconnect cancelled the handler (listener.py:
        # handler_cancellation) 0.2 s before decode's next batch came
        assert gone.completion_tokens == 1
        (grpc_row,) = [row for request_id, row in rows.items() if request_id.startswith(grpc_id)]
        usage = responses[-1].usage
        assert (grpc_row.status, grpc_row.http_status, grpc_row.api) == ("finished", 200, "grpc.generate")
        assert (grpc_row.prompt_tokens, grpc_row.cached_tokens, grpc_row.completion_tokens) == (
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
        )
        assert grpc_row.completion_tokens == num_completion


async def test_a_migrated_request_is_one_record_on_the_worker_it_ended_on(
    tmp_path: Path, served_model: ServedModel
) -> None:
    async with ledger_mesh("sqlite", tmp_path, served_model) as mesh:
        mesh.fakes.script.decode_error_after, mesh.fakes.script.decode_errors = 1, 1  # decode-a fails mid-stream
        async with aiohttp.ClientSession() as session:
            seen = await chat(session, mesh, 4)  # not streamed: prefill's token, decode-a's 2, then decode-b's
        await mesh.wait_for_rows(1)
        rows = await mesh.rows()
        assert list(rows) == [seen.request_id]  # not one per attempt
        assert (seen.status, seen.completion_tokens) == (200, len(mesh.fakes.script.token_ids))  # the whole answer
        row = rows[seen.request_id]
        assert (row.status, row.prefill_worker, row.decode_worker) == ("finished", "prefill-a", "decode-b")
        assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
            seen.prompt_tokens,
            seen.cached_tokens,
            seen.completion_tokens,
        )


def _record(request_id: str, prompt: int, cached: int, completion: int) -> events_pb2.UsageRecord:
    return events_pb2.UsageRecord(
        request_id=request_id,
        tenant_id="ten_00000000000000aa",
        key_id="key_00000000000000bb",
        model=MODEL,
        api="chat.completions",
        status="finished",
        http_status=200,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        e2e_ms=12.5,
        started_at_ms=1_795_000_000_000,
        ended_at_ms=1_795_000_000_013,
    )


async def _add_priced_tenant(database: Database) -> None:
    at = dt.datetime.now(dt.UTC)
    async with database.engine.begin() as connection:
        await connection.execute(
            schema.tenants.insert().values(
                id="ten_00000000000000aa", name="acme", limits={}, price_plan="pro", created_at=at, updated_at=at
            )
        )
        await connection.execute(
            schema.prices.insert().values(
                plan="pro",
                model=MODEL,
                input_per_mtok=Decimal("1.5"),
                cached_input_per_mtok=Decimal("0.375"),
                output_per_mtok=Decimal("6.000000001"),
                updated_at=at,
            )
        )


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_record_published_twice_is_written_once_and_priced_by_its_plan(
    backend: str, tmp_path: Path, served_model: ServedModel
) -> None:
    async with ledger_mesh(backend, tmp_path, served_model) as mesh:
        await _add_priced_tenant(mesh.database)
        js = mesh.consumer_bus.client.jetstream()
        await ensure_usage_stream(js)
        record = _record("req-twice", prompt=1000, cached=600, completion=250)
        subject = "kvmesh.usage.ten_00000000000000aa"
        first = await js.publish(subject, record.SerializeToString(), headers={MSG_ID_HEADER: "req-twice"})
        again = await js.publish(subject, record.SerializeToString(), headers={MSG_ID_HEADER: "req-twice"})
        assert again.duplicate and again.seq == first.seq  # the stream's window dropped the retry
        # a retry past the window (another message id, as after a long outage): the table's key drops it
        await js.publish(subject, record.SerializeToString(), headers={MSG_ID_HEADER: "req-twice-late"})
        await mesh.wait_for_rows(1)
        await asyncio.sleep(0.5)
        rows = await mesh.rows()
        assert list(rows) == ["req-twice"]
        assert sum(c.num_written for c in mesh.consumers()) == 1
        assert sum(c.num_duplicates for c in mesh.consumers()) == 1
        # 400 uncached x 1.5 + 600 cached x 0.375 + 250 x 6.000000001, per million tokens
        assert rows["req-twice"].cost == Decimal("0.002325000000")
        assert rows["req-twice"].price_plan == "pro"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_nats_killed_twice_and_the_consumer_once_lose_nothing(
    backend: str, tmp_path: Path, served_model: ServedModel
) -> None:
    async with ledger_mesh(backend, tmp_path, served_model) as mesh:
        mesh.fakes.script.batch_delay_s = 0.002
        started = time.monotonic()
        run = asyncio.create_task(run_requests(mesh, NUM_SOAK_REQUESTS))
        for fraction, what in ((0.2, "nats"), (0.45, "consumer"), (0.7, "nats")):
            while mesh.gateway.ledger is not None and mesh.gateway.ledger.num_published < fraction * NUM_SOAK_REQUESTS:
                await asyncio.sleep(0.01)
                if run.done():
                    break
            await (mesh.restart_nats() if what == "nats" else mesh.restart_consumer())
        seen = await run
        requests_s = time.monotonic() - started
        await assert_ledger_matches(mesh, seen)
        ledger = mesh.gateway.ledger
        assert ledger is not None and ledger.num_dropped == 0
        if "LEDGER_REQUESTS" in os.environ:  # the figures of docs/tenancy.md's run
            figures = {
                "backend": backend,
                "requests": len(seen),
                "rows": await mesh.num_rows(),
                "tokens": sum(s.prompt_tokens + s.completion_tokens for s in seen),
                "requests_seconds": round(requests_s, 2),
                "all_written_seconds": round(time.monotonic() - started, 2),
                "publish_retries": ledger.num_retries,
                "nats_restarts": 2,
                "consumer_restarts": 1,
            }
            print(json.dumps(figures))


async def test_a_full_queue_drops_and_counts_and_a_stop_flushes(tmp_path: Path) -> None:
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        bus = await Bus.connect(nats.url, name="publisher")
        publisher = UsagePublisher(bus, max_queued=3)
        for index in range(5):  # before start: nothing is sent yet, so the queue fills
            publisher.submit(_record(f"req-{index}", 1, 0, 1))
        assert (publisher.num_queued, publisher.num_dropped) == (3, 2)
        await publisher.start()
        await publisher.close()
        info = await bus.client.jetstream().stream_info("KVMESH_USAGE")
        assert (publisher.num_published, info.state.messages) == (3, 3)
        publisher.submit(_record("req-late", 1, 0, 1))  # after close: dropped and counted, never raised
        assert publisher.num_dropped == 3
        await bus.close()


async def test_an_open_record_waits_out_its_delay_and_is_dropped_when_its_request_record_comes_first(
    tmp_path: Path,
) -> None:
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        bus = await Bus.connect(nats.url, name="publisher")
        publisher = UsagePublisher(bus, open_delay_s=0.05)
        publisher.submit_open(_record("req-slow", 1, 0, 0))
        publisher.submit_open(_record("req-quick", 1, 0, 0))
        assert publisher.num_queued == 0  # neither goes out with the first token
        publisher.submit(_record("req-quick", 1, 0, 1))  # finished within the delay: its open record is moot
        assert publisher.num_queued == 1
        await asyncio.sleep(0.15)
        assert publisher.num_queued == 2  # req-slow's open record, after its delay
        publisher.submit_open(_record("req-stopping", 1, 0, 0))
        await publisher.start()
        await publisher.close()  # a stop queues the open records still waiting, then flushes
        js = bus.client.jetstream()
        sent = [events_pb2.UsageRecord.FromString((await js.get_msg("KVMESH_USAGE", seq)).data) for seq in (1, 2, 3)]
        assert [(r.request_id, r.status) for r in sent] == [
            ("req-quick", "finished"),
            ("req-slow", "open"),
            ("req-stopping", "open"),
        ]
        assert (await js.stream_info("KVMESH_USAGE")).state.messages == 3
        await bus.close()


async def test_a_batch_waits_for_the_records_that_come_while_it_lingers_and_a_stop_ends_the_linger(
    tmp_path: Path,
) -> None:
    async with empty_database_url("sqlite", tmp_path) as url:
        settings = load_settings(GatewaySettings, env={}, api_keys=(KEY,), database_url=url)
        database = await open_database(settings)
        nats = EmbeddedNats(store_dir=tmp_path / "nats").start()
        bus = await Bus.connect(nats.url, name="test-linger")
        consumer = LedgerConsumer(bus, database, linger_s=30.0)  # longer than the test: only the stop ends it
        try:
            await consumer.start()  # creates the stream
            js = bus.client.jetstream()
            for request_id in ("first", "second", "third"):
                record = _record(request_id, prompt=10, cached=0, completion=5)
                await js.publish("kvmesh.usage.t", record.SerializeToString(), headers={MSG_ID_HEADER: request_id})
                await asyncio.sleep(0.3)  # each after the consumer fetched the one before
            assert (consumer.num_batches, consumer.num_written) == (0, 0)  # holding "first", lingering
            stopping = time.monotonic()
            await consumer.stop(grace_s=5.0)
            assert time.monotonic() - stopping < 2.0  # the stop ended the linger; it did not wait out its grace
            assert (consumer.num_batches, consumer.num_written) == (1, 3)  # and the batch it held was written
            async with database.engine.connect() as connection:
                result = await connection.execute(select(schema.usage_records.c.request_id))
                assert sorted(row.request_id for row in result) == ["first", "second", "third"]
        finally:
            await consumer.stop(grace_s=0)
            await bus.client.close()
            nats.stop()
            await database.close()
