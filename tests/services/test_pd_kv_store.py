"""Prefill and the KV store: blocks are written to their rendezvous owners and read back into an empty device
cache; a failing or foreign block is a miss, never a failure; one tenant never reads another's KV.

Harness: the `mesh` fixture of tests/services/pd_harness.py (in-process workers).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine_core.kv_cache.block_hash import root_hash
from engine_core.kv_transfer import KVLayout
from kvmesh.nats_server import free_port
from mesh import subjects
from mesh.bus import Bus
from mesh.compute.convert import layout_to_proto
from mesh.discovery import Announcer
from mesh.pb import common_pb2, decode_pb2, events_pb2, kvcache_pb2
from mesh.placement import rendezvous_owner
from services.prefill.fetch_decision import FetchPlanner, RateFit
from services.prefill.prefiller import StoreBlock
from services.prefill.store_client import StoreWriter, stored_prefix_length

from . import pd_harness
from .pd_harness import (
    GREEDY,
    HEARTBEAT_S,
    LLAMA_BLOCK_BYTES,
    Mesh,
    metric,
    next_heartbeat,
    prompt_of,
    reference_outputs,
    wait_for_free_blocks,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

mesh, nats_url = pd_harness.mesh, pd_harness.nats_url  # fixtures: each test file starts its own mesh


async def test_the_stored_prefix_ends_at_the_first_miss_of_any_node():
    owners = ["a", "b", "a", "b", "a"]
    assert stored_prefix_length(owners, {"a": 3, "b": 2}) == 5
    assert stored_prefix_length(owners, {"a": 3, "b": 1}) == 3
    assert stored_prefix_length(owners, {"a": 1, "b": 2}) == 2
    assert stored_prefix_length(owners, {"b": 2}) == 0


class RecordingStore:
    def __init__(self) -> None:
        self.batches: list[list[bytes]] = []

    def is_available(self) -> bool:
        return True

    async def put(self, blocks) -> None:
        self.batches.append([b.block_hash for b in blocks])


async def test_the_store_writer_drops_what_its_queue_cannot_hold_and_batches_the_rest():
    store = RecordingStore()
    writer = StoreWriter(store, max_queued_bytes=100, max_batch_bytes=80)  # type: ignore[arg-type]
    layout = KVLayout("m", "float32", 16, 1, (1,), 0)
    dropped = metric("kvmesh_prefill_store_dropped_blocks_total")
    writer.offer([StoreBlock(bytes([i]), b"", layout, bytes(30)) for i in range(4)])  # 120 bytes: one too many
    assert metric("kvmesh_prefill_store_dropped_blocks_total") == dropped + 1
    writer.start()
    try:
        assert await writer.flush(5.0)
    finally:
        await writer.stop()
    assert store.batches == [[b"\0", b"\1"], [b"\2"]]  # at most 80 bytes a batch, in order
    assert writer.is_accepting


async def test_blocks_go_to_the_store_and_come_back_to_an_empty_device_cache(mesh: Mesh):
    model, prompt = mesh.llama, prompt_of(50, seed=7)
    engine = mesh.prefill.engines.get(model)
    keys = engine.prompt_block_hashes(prompt)
    assert len(keys) == 3
    batches: list[events_pb2.KVEventBatch] = []

    async def on_batch(batch: events_pb2.KVEventBatch, subject: str) -> None:
        batches.append(batch)

    bus = await Bus.connect(mesh.nats_url, "test-events")
    await bus.subscribe(subjects.kv_events("prefill-t"), events_pb2.KVEventBatch, on_batch)
    await bus.flush()
    one_token = dataclasses.replace(GREEDY, max_tokens=1)
    first = await mesh.prefill_stub.Prefill(mesh.request("to-store", model, prompt, one_token))
    assert first.num_store_tokens == 0

    # written in the background, each block to its rendezvous owner, chained to its parent
    def stored() -> dict[bytes, tuple[str, object]]:
        return {k: (node, store.blocks[k]) for node, store in mesh.stores.items() for k in keys if k in store.blocks}

    await wait_until(lambda: len(stored()) == 3, what="the prompt's blocks in the store")
    parents = [root_hash(model), *keys[:2]]
    layout = layout_to_proto(mesh.prefill.engines.layout(model))
    for key, parent in zip(keys, parents, strict=True):
        node, block = stored()[key]
        assert node == rendezvous_owner(key, sorted(mesh.stores))
        assert (block.parent_hash, block.layout, len(block.data)) == (parent, layout, LLAMA_BLOCK_BYTES)

    # the device cache forgets everything; the next request finds the prefix in the store
    assert await engine.call(lambda e: e.kv.pool.reset_prefix_cache())
    store_tokens_before = metric("kvmesh_prefill_cached_tokens_total", model=model, tier="store")
    expected, _ = reference_outputs(model, prompt, GREEDY)
    second = await mesh.prefill_stub.Prefill(mesh.request("from-store", model, prompt, GREEDY))
    assert (second.num_cached_tokens, second.num_store_tokens) == (48, 48)
    batches_out = [b async for b in mesh.decode_stub.Stream(decode_pb2.StreamRequest(request_id="from-store"))]
    assert [second.first_token_id] + [t for b in batches_out for t in b.token_ids] == expected
    assert metric("kvmesh_prefill_cached_tokens_total", model=model, tier="store") == store_tokens_before + 48
    assert mesh.prefill.writer is not None and await mesh.prefill.writer.flush(5.0)
    assert all(mesh.stores[node].num_puts[k] == 1 for k, (node, _) in stored().items())  # injected: not put again
    beat = await next_heartbeat(mesh.nats_url, "prefill", "prefill-t", lambda b: b.load.num_cached_blocks >= 3)
    assert beat.load.num_running == 0 and beat.load.kv_usage == 0

    # the same changes went out on NATS, numbered without gaps
    await bus.flush()
    await wait_until(lambda: any(e.HasField("all_cleared") for b in batches for e in b.events), what="KV events")
    await bus.close()
    assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))
    assert {b.tier for b in batches} == {"device"} and {b.worker_id for b in batches} == {"prefill-t"}
    ours = [e.stored for b in batches for e in b.events if e.HasField("stored") and e.stored.block_hashes[0] == keys[0]]
    assert [(list(e.block_hashes), e.parent_hash, e.model, e.block_size) for e in ours] == [
        (keys, root_hash(model), model, 16)
    ] * 2  # computed, then injected from the store


async def test_a_prefix_the_store_cannot_extend_costs_one_engine_call_before_the_first_token(mesh: Mesh, monkeypatch):
    model, prompt = mesh.llama, prompt_of(50, seed=11)
    engine = mesh.prefill.engines.get(model)
    one_token = dataclasses.replace(GREEDY, max_tokens=1)  # ends at prefill: no export, no push
    first = await mesh.prefill_stub.Prefill(mesh.request("cached-first", model, prompt, one_token))
    assert first.num_cached_tokens == 0
    calls = []
    call = engine.call

    async def counted(fn):
        calls.append(fn)
        return await call(fn)

    monkeypatch.setattr(engine, "call", counted)
    second = await mesh.prefill_stub.Prefill(mesh.request("cached-again", model, prompt, one_token))
    assert (second.num_cached_tokens, second.num_store_tokens) == (48, 0)
    assert len(calls) == 1  # the call that found every block cached admitted the request: no lookup call first


async def test_a_failing_or_foreign_store_block_is_a_miss_never_a_failure(mesh: Mesh):
    model = mesh.llama
    engine = mesh.prefill.engines.get(model)
    bus = await Bus.connect(mesh.nats_url, "test-dead-store")
    dead = common_pb2.WorkerInfo(
        worker_id="kvcache-dead", role=common_pb2.ROLE_KVCACHE, address=f"127.0.0.1:{free_port()}"
    )
    announcer = Announcer(bus, dead, common_pb2.WorkerLoad, HEARTBEAT_S)
    await announcer.start()
    try:
        assert mesh.prefill.registry is not None
        await wait_until(lambda: mesh.prefill.registry.get("kvcache-dead") is not None, what="the dead node")
        nodes = [*mesh.stores, "kvcache-dead"]
        # a prompt whose first block the dead node owns, and one whose first block a live node owns
        prompts = [prompt_of(40, seed=100 + i) for i in range(40)]
        owners = [rendezvous_owner(engine.prompt_block_hashes(p)[0], nodes) for p in prompts]
        to_dead = prompts[owners.index("kvcache-dead")]
        to_live, live_owner = next((p, o) for p, o in zip(prompts, owners, strict=True) if o != "kvcache-dead")

        lookup_errors = metric("kvmesh_prefill_store_errors_total", op="lookup")
        expected, _ = reference_outputs(model, to_dead, GREEDY)
        response = await mesh.prefill_stub.Prefill(mesh.request("dead-store", model, to_dead, GREEDY))
        assert response.num_store_tokens == 0 and response.first_token_id == expected[0]
        assert metric("kvmesh_prefill_store_errors_total", op="lookup") == lookup_errors + 1
        await mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="dead-store"))

        # a block the store holds in another layout (another build of the model) is skipped, not injected
        key = engine.prompt_block_hashes(to_live)[0]
        wrong = layout_to_proto(dataclasses.replace(mesh.prefill.engines.layout(model), layer_shape=(1, 2, 3)))
        mesh.stores[live_owner].blocks[key] = _block(key, root_hash(model), wrong, bytes(24))
        response = await mesh.prefill_stub.Prefill(mesh.request("foreign", model, to_live, GREEDY))
        assert (response.num_store_tokens, response.num_cached_tokens) == (0, 0)
        await mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="foreign"))
    finally:
        await announcer.stop()
        await bus.close()
    await wait_for_free_blocks(mesh.decode, model)


async def test_one_tenant_never_gets_another_tenants_kv_through_the_store(mesh: Mesh):
    model, prompt = mesh.llama, prompt_of(50, seed=11)
    engine = mesh.prefill.engines.get(model)
    one_token = dataclasses.replace(GREEDY, max_tokens=1)
    keys_a = engine.prompt_block_hashes(prompt, "tenant-a")
    keys_b = engine.prompt_block_hashes(prompt, "tenant-b")
    assert len(keys_a) == 3 and not set(keys_a) & set(keys_b)  # the salt enters every key: same tokens, other keys
    await mesh.prefill_stub.Prefill(mesh.request("tenant-a", model, prompt, one_token, cache_salt="tenant-a"))
    await wait_until(
        lambda: all(any(k in s.blocks for s in mesh.stores.values()) for k in keys_a),
        what="tenant a's blocks in the store",
    )
    assert await engine.call(lambda e: e.kv.pool.reset_prefix_cache())
    other = await mesh.prefill_stub.Prefill(mesh.request("tenant-b", model, prompt, one_token, cache_salt="tenant-b"))
    assert (other.num_cached_tokens, other.num_store_tokens) == (0, 0)  # the same prompt, none of a's KV
    assert await engine.call(lambda e: e.kv.pool.reset_prefix_cache())
    again = await mesh.prefill_stub.Prefill(mesh.request("tenant-a2", model, prompt, one_token, cache_salt="tenant-a"))
    assert (again.num_cached_tokens, again.num_store_tokens) == (48, 48)  # a itself gets its prefix back


def _block(key: bytes, parent: bytes, layout: common_pb2.KVLayout, data: bytes) -> kvcache_pb2.Block:
    return kvcache_pb2.Block(block_hash=key, parent_hash=parent, layout=layout, data=data)


async def test_a_prefix_in_the_store_is_read_or_computed_as_the_measured_rates_say(mesh: Mesh, monkeypatch):
    model, prompt = mesh.llama, prompt_of(50, seed=13)
    engine = mesh.prefill.engines.get(model)
    one_token = dataclasses.replace(GREEDY, max_tokens=1)
    await mesh.prefill_stub.Prefill(mesh.request("rates-first", model, prompt, one_token))
    keys = engine.prompt_block_hashes(prompt)
    await wait_until(lambda: sum(k in s.blocks for s in mesh.stores.values() for k in keys) == 3, what="stored")
    assert mesh.prefill.prefiller is not None
    expected, _ = reference_outputs(model, prompt, one_token)

    async def served(request_id: str, planner: FetchPlanner) -> tuple[int, int, int]:
        monkeypatch.setattr(mesh.prefill.prefiller, "planner", planner)
        assert await engine.call(lambda e: e.kv.pool.reset_prefix_cache())
        response = await mesh.prefill_stub.Prefill(mesh.request(request_id, model, prompt, one_token))
        return response.num_cached_tokens, response.num_store_tokens, response.first_token_id

    before = metric("kvmesh_prefill_kv_fetch_decisions_total", choice="recompute")
    slow_store = FetchPlanner("auto", store=RateFit(fixed_s=5.0, per_unit_s=1e-9), probe_interval_s=math.inf)
    assert await served("rates-slow-store", slow_store) == (0, 0, expected[0])
    assert metric("kvmesh_prefill_kv_fetch_decisions_total", choice="recompute") == before + 1

    before = metric("kvmesh_prefill_kv_fetch_decisions_total", choice="fetch")
    slow_engine = FetchPlanner("auto", compute=RateFit(fixed_s=0.01, per_unit_s=1.0), probe_interval_s=math.inf)
    assert await served("rates-slow-engine", slow_engine) == (48, 48, expected[0])
    assert metric("kvmesh_prefill_kv_fetch_decisions_total", choice="fetch") == before + 1
    assert slow_engine.store.num_samples == 1  # the read it made was measured
