"""The balancer: Router picks and the KV index with exact values, then the service on a real NATS, with workers
made present by real Announcers and caches by real KV event batches."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY

from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import subjects
from mesh.bus import Bus
from mesh.discovery import Announcer, now_ms
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2, events_pb2
from services.balancer.config import BalancerSettings
from services.balancer.kv_index import KVIndex
from services.balancer.router import NoWorkerError, RouteRequest, Router, WorkerPair, WorkerState
from services.balancer.server import apply_kv_batch, serve
from tests.services.harness import serving, wait_until

BLOCK_SIZE = 16


def key(i: int) -> bytes:
    return bytes([i]) * 32


def worker(worker_id: str, heartbeat_ms: int = 1, **load: int) -> WorkerState:
    """A worker with 8 sequences and 100 blocks of 16 tokens (1,600 KV tokens) of capacity."""
    return WorkerState(worker_id=worker_id, heartbeat_ms=heartbeat_ms, block_size=BLOCK_SIZE, max_num_seqs=8,
                       num_kv_blocks=100, **load)


def request(num_prompt_tokens: int, *block_ids: int, exclude: tuple[str, ...] = ()) -> RouteRequest:
    return RouteRequest(model="m", block_hashes=tuple(key(i) for i in block_ids),
                        num_prompt_tokens=num_prompt_tokens, exclude_worker_ids=frozenset(exclude))


DECODE = [worker("d-a")]


# --- KVIndex -----------------------------------------------------------------------------------------------------

def test_index_follows_stored_removed_and_cleared_blocks() -> None:
    index = KVIndex()
    index.add("p-a", [key(1), key(2), key(3)])
    assert index.num_leading_hits("p-a", [key(1), key(2), key(3), key(4)]) == 3
    index.remove("p-a", [key(2)])
    assert index.num_leading_hits("p-a", [key(1), key(2), key(3)]) == 1
    assert index.num_leading_hits("p-a", [key(3)]) == 1
    assert index.num_leading_hits("p-b", [key(1)]) == 0
    index.clear("p-a")
    assert (index.num_blocks("p-a"), index.num_leading_hits("p-a", [key(1)])) == (0, 0)


def test_index_reports_skipped_batches_and_forgets_a_dropped_worker() -> None:
    index = KVIndex()
    assert [index.check_seq("p-a", seq) for seq in (4, 5, 8, 9)] == [0, 0, 2, 0]
    index.add("p-a", [key(1)])
    index.drop("p-a")
    assert (index.num_blocks("p-a"), index.check_seq("p-a", 12)) == (0, 0)


def test_index_forgets_a_worker_whose_event_stream_starts_over() -> None:
    index = KVIndex()
    index.check_seq("p-a", 7)
    index.add("p-a", [key(1), key(2)])
    assert index.check_seq("p-a", 8) == 0
    assert index.num_blocks("p-a") == 2
    assert index.check_seq("p-a", 1) == 0  # a restarted process under the same id
    assert index.num_blocks("p-a") == 0


def test_kv_event_batches_apply_in_order() -> None:
    index = KVIndex()
    stored = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[key(1), key(2), key(3)]))
    removed = events_pb2.KVEvent(removed=events_pb2.KVBlocksRemoved(block_hashes=[key(2)]))
    apply_kv_batch(index, "p-a", events_pb2.KVEventBatch(worker_id="p-a", seq=1, events=[stored, removed]))
    assert index.num_leading_hits("p-a", [key(1), key(2), key(3)]) == 1
    cleared = events_pb2.KVEvent(all_cleared=True)
    again = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[key(5)]))
    apply_kv_batch(index, "p-a", events_pb2.KVEventBatch(worker_id="p-a", seq=2, events=[cleared, again]))
    assert (index.num_blocks("p-a"), index.num_leading_hits("p-a", [key(5)])) == (1, 1)


# --- Router: prefill ---------------------------------------------------------------------------------------------

def test_prefill_pick_credits_the_worker_holding_the_longest_prefix() -> None:
    index = KVIndex()
    index.add("p-b", [key(1), key(2)])
    index.add("p-c", [key(1), key(3)])
    router = Router(index)
    pool = [worker("p-a"), worker("p-b"), worker("p-c")]
    req = request(48, 1, 2, 3)
    assert [router.prefill_work(req, w) for w in pool] == [48, 16, 32]
    assert router.route(req, pool, DECODE) == WorkerPair("p-b", "d-a", 32)


def test_prefill_pick_weighs_a_queue_against_a_cache() -> None:
    index = KVIndex()
    index.add("p-b", [key(1), key(2)])
    router = Router(index)
    pool = [worker("p-a", num_queued_prompt_tokens=20), worker("p-b", num_queued_prompt_tokens=60)]
    assert [router.prefill_work(request(48, 1, 2, 3), w) for w in pool] == [68, 76]
    assert router.route(request(48, 1, 2, 3), pool, DECODE) == WorkerPair("p-a", "d-a", 0)


def test_a_burst_spreads_until_a_new_heartbeat_restarts_the_counts() -> None:
    router = Router(KVIndex())
    pool = [worker("p-a"), worker("p-b", num_queued_prompt_tokens=50)]
    picks = [router.route(request(100), pool, DECODE).prefill_worker_id for _ in range(4)]
    # predicted (p-a, p-b) work at each pick: (100, 150), (200, 150), (200, 250), (300, 250)
    assert picks == ["p-a", "p-b", "p-a", "p-b"]
    assert [router.prefill_work(request(100), w) for w in pool] == [300, 350]
    fresh = [worker("p-a", heartbeat_ms=2, num_queued_prompt_tokens=180), pool[1]]
    assert [router.prefill_work(request(100), w) for w in fresh] == [280, 350]


def test_routed_tokens_are_the_uncached_ones() -> None:
    index = KVIndex()
    index.add("p-a", [key(1), key(2)])
    router = Router(index)
    pool = [worker("p-a"), worker("p-b", num_queued_prompt_tokens=30)]
    assert router.route(request(40, 1, 2), pool, DECODE) == WorkerPair("p-a", "d-a", 32)
    assert [router.prefill_work(request(10), w) for w in pool] == [18, 40]  # p-a was sent the 8 uncached tokens


def test_prefill_ties_go_to_the_worker_picked_least_among_recent_routes() -> None:
    index = KVIndex()
    for worker_id in ("p-a", "p-b", "p-c"):
        index.add(worker_id, [key(1), key(2)])
    router = Router(index, num_recent_routes=2)
    pool = [worker("p-a"), worker("p-b"), worker("p-c")]
    fully_cached = request(32, 1, 2)  # adds no work anywhere: every pick is a tie on work
    picks = [router.route(fully_cached, pool, DECODE).prefill_worker_id for _ in range(5)]
    # the window holds the last 2 picks: (a), (a, b), (b, c), (c, a), (a, b)
    assert picks == ["p-a", "p-b", "p-c", "p-a", "p-b"]


# --- Router: decode, exclusions, empty pools ---------------------------------------------------------------------

def test_decode_pick_balances_request_count_and_kv_length() -> None:
    router = Router(KVIndex())
    pool = [worker("d-a", num_running=4), worker("d-b", num_running=1, num_kv_tokens=1200),
            worker("d-c", num_running=2, num_kv_tokens=320)]
    assert [router.decode_load(w) for w in pool] == [0.5, 0.875, 0.45]
    assert router.route(request(16), [worker("p-a")], pool).decode_worker_id == "d-c"


def test_a_decode_burst_counts_the_requests_and_kv_routed_since_the_heartbeat() -> None:
    router = Router(KVIndex())
    pool = [worker("d-b"), worker("d-a")]
    assert router.route(request(160), [worker("p-a")], pool).decode_worker_id == "d-a"  # a tie: worker id
    assert [router.decode_load(w) for w in pool] == [0.0, 0.225]  # 1/8 + 160/1600
    picks = [router.route(request(160), [worker("p-a")], pool).decode_worker_id for _ in range(3)]
    assert picks == ["d-b", "d-a", "d-b"]


def test_excluded_workers_are_skipped() -> None:
    index = KVIndex()
    index.add("p-b", [key(1)])
    router = Router(index)
    prefill = [worker("p-a"), worker("p-b")]
    decode = [worker("d-a"), worker("d-b", num_running=7)]
    assert router.route(request(32, 1, exclude=("p-b", "d-a")), prefill, decode) == WorkerPair("p-a", "d-b", 0)


def test_an_empty_pool_names_the_model_and_the_pool() -> None:
    router = Router(KVIndex())
    with pytest.raises(NoWorkerError, match=r"^no prefill worker serves model 'm'$"):
        router.route(request(16), [], DECODE)
    with pytest.raises(NoWorkerError, match=r"^no decode worker serves model 'm' \(1 excluded\)$"):
        router.route(request(16, exclude=("d-a",)), [worker("p-a")], DECODE)


# --- the service on a real NATS ----------------------------------------------------------------------------------

INTERVAL_S = 0.2


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats")) as nats:
        yield nats.url


async def start_worker(nats_url: str, worker_id: str, role: int, **load: int) -> Announcer:
    """A worker's presence: its own NATS connection beating every INTERVAL_S, exactly as a worker's runtime does."""
    bus = await Bus.connect(nats_url, name=worker_id)
    port = 7000 + int(worker_id[-1])
    info = common_pb2.WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{port}",  # type: ignore[arg-type]
                                 models=["m"], max_num_seqs=8, num_kv_blocks=100, block_size=BLOCK_SIZE)
    announcer = Announcer(bus, info, lambda: common_pb2.WorkerLoad(**load), INTERVAL_S)
    await announcer.start()
    return announcer


def route_request(*block_ids: int, num_prompt_tokens: int = 48, model: str = "m",
                  exclude: tuple[str, ...] = ()) -> balancer_pb2.RouteRequest:
    return balancer_pb2.RouteRequest(request_id="r", model=model, block_hashes=[key(i) for i in block_ids],
                                     num_prompt_tokens=num_prompt_tokens, exclude_worker_ids=exclude)


def picked(response: balancer_pb2.RouteResponse) -> tuple[str, str, int]:
    return response.prefill.worker_id, response.decode.worker_id, response.num_cached_tokens


async def listed(stub: balancer_pb2_grpc.BalancerStub) -> dict[str, balancer_pb2.WorkerStatus]:
    response = await stub.ListWorkers(balancer_pb2.ListWorkersRequest())
    return {status.worker.worker_id: status for status in response.workers}


async def stored_batch(bus: Bus, worker_id: str, seq: int, *block_ids: int) -> None:
    event = events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(
        block_hashes=[key(i) for i in block_ids], parent_hash=b"\0" * 32, block_size=BLOCK_SIZE, model="m"))
    await bus.publish(subjects.kv_events(worker_id), events_pb2.KVEventBatch(
        worker_id=worker_id, seq=seq, tier="device", events=[event]))


async def heard_after(stub: balancer_pb2_grpc.BalancerStub, worker_id: str, since_ms: int) -> None:
    """Until the balancer has a heartbeat of `worker_id` sent after `since_ms`. NATS keeps one connection's
    messages in order, so the KV batches that worker published before it have been read by then."""
    async def newer() -> bool:
        status = (await listed(stub)).get(worker_id)
        return status is not None and status.last_seen_ms > since_ms
    await wait_until(newer)


async def expect_unavailable(stub: balancer_pb2_grpc.BalancerStub, request: balancer_pb2.RouteRequest) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Route(request)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    return str(error.value.details())


async def test_service_routes_by_heartbeats_and_kv_events_and_follows_leaving_workers(nats_url: str) -> None:
    settings = BalancerSettings(nats_url=nats_url, grpc_port=free_port(), http_port=free_port(),
                                worker_id="balancer-test", heartbeat_interval_s=INTERVAL_S)
    routes_before = REGISTRY.get_sample_value("kvmesh_balancer_routes_total", {"pool": "prefill", "worker": "p-2"})
    async with serving(serve, settings) as channel:
        stub = balancer_pb2_grpc.BalancerStub(channel)
        workers = {
            "p-1": await start_worker(nats_url, "p-1", common_pb2.ROLE_PREFILL),
            "p-2": await start_worker(nats_url, "p-2", common_pb2.ROLE_PREFILL),
            "d-1": await start_worker(nats_url, "d-1", common_pb2.ROLE_DECODE, num_running=3),
            "d-2": await start_worker(nats_url, "d-2", common_pb2.ROLE_DECODE, num_running=1),
        }

        async def all_listed() -> bool:
            return set(await listed(stub)) == set(workers)
        await wait_until(all_listed)
        status = (await listed(stub))["d-1"]
        assert (status.load.num_running, status.worker.address, status.last_seen_ms > 0) == (3, "127.0.0.1:7001", True)
        assert REGISTRY.get_sample_value("kvmesh_balancer_workers", {"pool": "prefill"}) == 2

        since = now_ms()
        await stored_batch(workers["p-2"].bus, "p-2", 1, 1, 2)
        await heard_after(stub, "p-2", since)
        response = await stub.Route(route_request(1, 2, 3))
        assert picked(response) == ("p-2", "d-2", 32)
        assert response.prefill.address == "127.0.0.1:7002"
        assert picked(await stub.Route(route_request(1, 2, 3, exclude=("p-2",)))) == ("p-1", "d-2", 0)
        assert await expect_unavailable(stub, route_request(model="other")) == "no prefill worker serves model 'other'"
        routes_after = REGISTRY.get_sample_value("kvmesh_balancer_routes_total", {"pool": "prefill", "worker": "p-2"})
        assert (routes_after or 0) - (routes_before or 0) == 1

        await workers["p-1"].stop()  # graceful: a `leaving` heartbeat

        async def p1_gone() -> bool:
            return "p-1" not in await listed(stub)
        await wait_until(p1_gone, timeout_s=2)
        assert (await expect_unavailable(stub, route_request(exclude=("p-2",)))
                == "no prefill worker serves model 'm' (1 excluded)")

        await workers["d-2"].bus.client.close()  # a crash: its heartbeats stop, no `leaving`
        crashed = time.monotonic()

        async def d2_gone() -> bool:
            return "d-2" not in await listed(stub)
        await wait_until(d2_gone, timeout_s=3)
        assert 1.5 * INTERVAL_S <= time.monotonic() - crashed <= 3 * INTERVAL_S + 1.0  # three missed intervals
        assert picked(await stub.Route(route_request(1, 2, 3))) == ("p-2", "d-1", 32)

        await workers["p-2"].stop()  # leaving takes its cache entry with it: when it is back, it holds nothing known
        await workers["p-2"].bus.close()
        await wait_until(lambda: _absent(stub, "p-2"), timeout_s=2)
        workers["p-2"] = await start_worker(nats_url, "p-2", common_pb2.ROLE_PREFILL)
        await heard_after(stub, "p-2", 0)
        assert picked(await stub.Route(route_request(1, 2, 3))) == ("p-2", "d-1", 0)
        for announcer in workers.values():
            await announcer.stop()
            await announcer.bus.close()


async def _absent(stub: balancer_pb2_grpc.BalancerStub, worker_id: str) -> bool:
    return worker_id not in await listed(stub)
