"""Routing policies (mesh.routing) on small scenarios with exact picks and costs: the baselines, the kvmesh policy
(predicted TTFT, bounded imbalance on a hot prefix, the pending-cache view, predicted decode KV), the Router's
pools and peer assignments."""

from __future__ import annotations

import math

import pytest

from mesh.kv_index import GlobalKVIndex
from mesh.routing import Assignment, CostModel, NoWorkerError, PrefillPick, Router, RouteRequest, WorkerState
from mesh.routing.context import PickContext
from mesh.routing.kvmesh import KvmeshDecode, KvmeshPrefill
from mesh.routing.view import LoadView

# prefill_s(cached, new) = new / 1000 * (1 + (cached + new / 2) / 1000); fetching or pushing a token: 1 ms
COST = CostModel(
    prefill_tokens_per_s=1000.0,
    prefill_overhead_s=0.0,
    attention_knee_tokens=1000.0,
    kv_bytes_per_token=1000,
    host_bytes_per_s=1e6,
    ssd_bytes_per_s=1e6,
    network_bytes_per_s=1e6,
    decode_step_base_s=0.01,
    decode_s_per_kv_token=0.0,
)


def key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 16


def worker(worker_id: str, reported_s: float = 0.0, **load: int) -> WorkerState:
    """16-token blocks, 8 sequences, 100 blocks (1,600 tokens) of KV."""
    return WorkerState(worker_id, reported_s, block_size=16, max_num_seqs=8, num_kv_blocks=100, **load)


def request(
    num_prompt_tokens: int, *block_ids: int, request_id: str = "", exclude: tuple[str, ...] = ()
) -> RouteRequest:
    return RouteRequest("m", tuple(key(i) for i in block_ids), num_prompt_tokens, request_id, frozenset(exclude))


PREFILL = [worker("p-a"), worker("p-b"), worker("p-c")]
DECODE = [worker("d-a"), worker("d-b")]


def picks(
    router: Router,
    requests: list[RouteRequest],
    prefill: list[WorkerState] = PREFILL,
    decode: list[WorkerState] = DECODE,
    now_s: float = 0.0,
) -> list[tuple[str, str]]:
    routes = [router.route(r, prefill, decode, now_s)[0] for r in requests]
    return [(route.prefill_worker_id, route.decode_worker_id) for route in routes]


# -- baselines ------------------------------------------------------------------------------------------------------


def test_round_robin_takes_turns_in_both_pools() -> None:
    router = Router("round_robin", GlobalKVIndex(), COST)
    assert picks(router, [request(48, 1)] * 4) == [("p-a", "d-a"), ("p-b", "d-b"), ("p-c", "d-a"), ("p-a", "d-b")]


def test_least_load_counts_queued_tokens_assigned_since_the_report() -> None:
    router = Router("least_load", GlobalKVIndex(), COST)
    prefill = [worker("p-a", num_queued_prompt_tokens=100), worker("p-b"), worker("p-c", num_queued_prompt_tokens=50)]
    decode = [worker("d-a", num_running=2), worker("d-b")]
    # prefill queues (a, b, c) before each pick: (100, 0, 50), (100, 48, 50), (100, 96, 50), (100, 96, 98)
    # decode requests before each pick: (2, 0), (2, 1), (2, 2): a tie on requests goes to fewer KV tokens
    assert picks(router, [request(48)] * 4, prefill, decode) == [
        ("p-b", "d-b"),
        ("p-b", "d-b"),
        ("p-c", "d-a"),
        ("p-b", "d-b"),
    ]
    assert router.view.num_queued_tokens(prefill[1]) == 144
    router.update(worker("p-b", reported_s=1.0, num_queued_prompt_tokens=20))  # the report includes all three
    assert router.view.num_queued_tokens(router.view.report("p-b")) == 20  # type: ignore[arg-type]


def test_cache_aware_follows_its_tree_above_the_threshold_and_the_shortest_queue_when_imbalanced() -> None:
    router = Router("cache_aware", GlobalKVIndex(), COST)
    first = picks(router, [request(64, 1, 2, 3, 4), request(64, 1, 2, 3, 5), request(32, 9, 10)])
    # no trees: the smallest (all empty), then fewest requests, then id; 3 of 4 blocks match p-a's tree (> 50%);
    # no match: the smallest tree, p-b (p-c ties on size but p-b comes first)
    assert [p for p, _ in first] == ["p-a", "p-a", "p-b"]
    busy = [
        worker("p-a", reported_s=1.0, num_waiting=100),
        worker("p-b", reported_s=1.0),
        worker("p-c", reported_s=1.0),
    ]
    # 100 > 64 and > 1.5 x 0: the fewest requests (the reports include every earlier pick), p-b before p-c
    assert picks(router, [request(64, 1, 2, 3, 4)], busy, now_s=1.0)[0][0] == "p-b"


def test_kv_aware_credits_device_and_host_tiers() -> None:
    index = GlobalKVIndex()
    index.add("p-a", [key(1), key(2)])
    index.add("p-b", [key(1)])
    index.add("kv-0", [key(1), key(2), key(3)], tier="host")
    router = Router("kv_aware", index, COST)
    decode = [worker("d-a", num_kv_tokens=500), worker("d-b", num_kv_tokens=100)]
    # blocks (queued + 64 - credited) / 16, credited = device + 0.75 x host tokens:
    # p-a 32 + 0.75 x 16 -> 1.25; p-b 16 + 0.75 x 32 -> 1.5; p-c 0.75 x 48 -> 1.75
    assert picks(router, [request(64, 1, 2, 3, 4)], decode=decode) == [("p-a", "d-b")]
    queued = [worker("p-a", num_queued_prompt_tokens=16), worker("p-b"), worker("p-c")]  # p-a: 2.25
    assert picks(Router("kv_aware", index, COST), [request(64, 1, 2, 3, 4)], queued, decode)[0][0] == "p-b"


def test_deepseek_spreads_each_context_length_bucket_and_weighs_requests_and_kv_for_decode() -> None:
    router = Router("deepseek", GlobalKVIndex(), COST)
    prefill = [worker("p-a"), worker("p-b")]
    decode = [
        WorkerState(w, 0.0, 16, 8, 1000, num_running=n, num_kv_tokens=kv)  # 16,000 KV tokens each
        for w, n, kv in (("d-a", 4, 0), ("d-b", 1, 1200), ("d-c", 2, 320))
    ]
    long, short = request(5000), request(100)  # buckets 1 and 0
    # prefill: the least spent in the bucket, then overall; decode: requests / 8 + KV / 16,000, before each pick
    # (0.5, 0.2, 0.27), (0.5, 0.6375, 0.27), (0.5, 0.6375, 0.40125), (0.5, 0.6375, 0.83875)
    assert picks(router, [long, short, long, short], prefill, decode) == [
        ("p-a", "d-b"),
        ("p-b", "d-c"),
        ("p-b", "d-c"),
        ("p-a", "d-a"),
    ]


# -- kvmesh ---------------------------------------------------------------------------------------------------------


def test_kvmesh_prefill_predicts_time_to_first_token_from_the_cached_prefix() -> None:
    index = GlobalKVIndex()
    index.add("p-b", [key(1), key(2), key(3)])
    route, assignment = Router("kvmesh", index, COST).route(request(64, 1, 2, 3, 4), PREFILL, DECODE, 0.0)
    # p-b computes 16 tokens after 48 cached: 0.016 x (1 + 56/1000); the others 64: 0.064 x 1.032
    assert (route.prefill_worker_id, route.num_cached_tokens) == ("p-b", 48)
    assert route.predicted_ttft_s == pytest.approx(0.016896)
    assert (assignment.num_uncached_tokens, assignment.prefill_s) == (16, pytest.approx(0.016896))
    assert assignment.decode_arrival_s == pytest.approx(0.016896 + 0.064)  # + pushing 64 tokens' KV


def test_kvmesh_waits_for_its_cache_only_within_the_imbalance_bound() -> None:
    index = GlobalKVIndex()
    index.add("p-a", [key(n) for n in range(1, 9)])  # a 128-token prefix
    hot = request(136, *range(1, 10))
    # p-b would compute all 136 tokens: 0.136 x 1.068 = 0.145248 s; the bound is that x 2 + 4 x that = 0.871488 s
    within = [worker("p-a", num_queued_prompt_tokens=800), worker("p-b")]  # p-a: 0.8 s queued + 0.009056 s
    assert Router("kvmesh", index, COST).route(hot, within, DECODE, 0.0)[0].prefill_worker_id == "p-a"
    beyond = [worker("p-a", num_queued_prompt_tokens=900), worker("p-b")]  # p-a: 0.909056 s
    assert Router("kvmesh", index, COST).route(hot, beyond, DECODE, 0.0)[0].prefill_worker_id == "p-b"


def test_an_idle_pool_starts_at_once_a_busy_one_waits_for_the_cache() -> None:
    index = GlobalKVIndex()
    index.add("p-a", [key(n) for n in range(1, 9)])
    hot = request(136, *range(1, 10))
    # p-a's queue: 0.2 s. The recompute weight (30) counts by the share of busy workers: with p-b idle (1 of 2),
    # p-b's 0.136 s of extra compute weighs 15 x 0.136192 = 2.04 s against p-a's 0.2 s of queue
    assert (
        Router("kvmesh", index, COST)
        .route(hot, [worker("p-a", num_queued_prompt_tokens=200), worker("p-b")], DECODE, 0.0)[0]
        .prefill_worker_id
        == "p-a"
    )
    # a single worker idle among 21 busy ones: weight 30 / 21; p-b: 0.145 + 0.195 = 0.340 s, p-a 0.2 + 0.009 s
    idle = [worker(f"p-{n:02}", num_queued_prompt_tokens=5000) for n in range(20)]
    pool = [worker("p-a", num_queued_prompt_tokens=200), worker("p-b"), *idle]
    assert Router("kvmesh", index, COST).route(hot, pool, DECODE, 0.0)[0].prefill_worker_id == "p-a"


def test_a_hot_prefix_spills_to_a_second_worker_instead_of_piling_up() -> None:
    index = GlobalKVIndex()
    index.add("p-a", [key(n) for n in range(1, 9)])
    pool = [worker("p-a"), worker("p-b"), worker("p-c")]
    hot = [request(136, *range(1, 9), 100 + n, request_id=f"r{n}") for n in range(200)]
    for tail_quantile, first, counts in ((0.0, 96, {"p-a": 96, "p-b": 23, "p-c": 81}), (0.99, 23, None)):
        router = Router("kvmesh", index, COST)
        policy = router.prefill_policy = KvmeshPrefill(tail_quantile=tail_quantile)
        chosen = [router.route(r, pool, DECODE, 0.0)[0] for r in hot]
        first_elsewhere = next(n for n, r in enumerate(chosen) if r.prefill_worker_id != "p-a")
        assert first_elsewhere == first
        assert chosen[first_elsewhere].num_cached_tokens == 0 and chosen[-1].num_cached_tokens == 128
        if counts is not None:
            assert {w.worker_id: sum(r.prefill_worker_id == w.worker_id for r in chosen) for w in pool} == counts
        waits = [router.view.wait_s(w, 0.0) for w in pool]
        assert max(waits) - min(waits) <= 6 * 0.145248
    # Without the tail guard p-a takes requests (0.009056 s each) until its predicted TTFT passes the bound,
    # 2 x 0.145248 + 4 x 0.145248 (the least TTFT is an idle worker's full prefill), with the 96th; the prefix is then
    # copied to a second worker, which holds it from then on (the pending cache), then to the third. (The bounded
    # wait, the least TTFT + 8 typical full prefills of 0.145248, is looser here.) With it (the default), the 24th
    # would wait 0.217 s on p-a, past the tail the picks' TTFTs have tracked (0.2145 s), to save 0.136 s of compute
    # that costs the pool only 0.5 x that (one worker in three busy: 0.5 requests queued behind it, M/M/1): the
    # prefix is copied to an idle worker at once, and the three queues end within 0.009 s of each other.
    assert max(waits) - min(waits) == pytest.approx(0.697664 - 0.688608, abs=1e-6)
    assert policy.tail_ttft_s == pytest.approx(0.698543, abs=1e-6)


def test_a_cached_turn_does_not_wait_behind_a_long_prompt_past_some_typical_prefills() -> None:
    index = GlobalKVIndex()
    index.add("p-a", [key(n) for n in range(1, 38)])  # a conversation's 592 tokens
    pool = [worker("p-a"), worker("p-b")]
    turn = request(600, *range(1, 38), request_id="turn")
    chosen = {}
    for cap in (4.0, math.inf):
        router = Router("kvmesh", index, COST)
        router.prefill_policy = KvmeshPrefill(max_extra_wait_typical=cap)
        router.route(request(80, 1, 2, 3, 4, 5, request_id="short"), pool, DECODE, 0.0)  # typical: 0.0832 s
        long, _ = router.route(request(1000, 1, 2, 3, 4, *range(100, 160), request_id="long"), pool, DECODE, 0.0)
        assert (long.prefill_worker_id, long.predicted_ttft_s) == ("p-a", pytest.approx(1.43395, abs=1e-5))
        route, _ = router.route(turn, pool, DECODE, 0.0)
        chosen[cap] = (route.prefill_worker_id, route.num_cached_tokens, round(route.predicted_ttft_s, 4))
    # on p-a it would wait 1.434 s behind the long prompt to save 0.767 s of compute: past the least TTFT (0.78 s,
    # p-b computing it all) + 4 x the typical full prefill (0.0974 s, smoothed over the two before), so p-b
    assert chosen[4.0] == ("p-b", 0, 0.78)
    assert chosen[math.inf] == ("p-a", 592, 1.4467)  # without the cap, the recompute weight waits for the cache


def test_a_wait_into_the_tail_is_left_out_unless_the_compute_it_saves_costs_the_busy_pool_more() -> None:
    policy = KvmeshPrefill()
    policy.tail_ttft_s = 2.0  # as if tracked: the p99 of the picks' predicted TTFT
    cached = PrefillPick("p-a", 40_000, 0.04, 2.1)  # it would wait 2.06 s for its cache
    quickest = PrefillPick("p-b", 0, 0.74, 0.8)  # computes the whole prompt after a 0.06 s queue
    # one worker in four busy: the 0.70 s of compute the wait saves would delay 1/3 of a request queued behind it
    # (M/M/1 at 0.25), 0.23 s, against 1.3 s more TTFT for this one: it goes to p-b
    assert policy.is_tail_wait(cached, quickest, busy=0.25)
    # three in four busy: 3 requests behind it, 2.1 s of delay, more than the 1.3 s: it waits for its cache
    assert not policy.is_tail_wait(cached, quickest, busy=0.75)
    assert not policy.is_tail_wait(PrefillPick("p-a", 40_000, 0.04, 1.9), quickest, busy=0.25)  # below the tail
    assert not KvmeshPrefill(tail_quantile=0.0).is_tail_wait(cached, quickest, busy=0.25)  # nothing tracked


def test_kvmesh_counts_blocks_still_being_computed_as_cached_on_their_worker() -> None:
    router = Router("kvmesh", GlobalKVIndex(), COST)
    first, _ = router.route(request(64, 1, 2, 3, 4, request_id="turn-1"), PREFILL, DECODE, 0.0)
    second, _ = router.route(request(80, 1, 2, 3, 4, 5, request_id="turn-2"), PREFILL, DECODE, 0.01)
    assert second.prefill_worker_id == first.prefill_worker_id and second.num_cached_tokens == 64
    # the index never heard of those blocks: once the first turn is predicted done (+ 1 s), they stop counting
    late, _ = router.route(request(80, 1, 2, 3, 4, 5, request_id="turn-3"), PREFILL, DECODE, 5.0)
    assert late.num_cached_tokens == 0


def test_the_tail_guard_counts_a_worker_busy_only_past_half_a_typical_prefill() -> None:
    policy = KvmeshPrefill()
    policy.tail_ttft_s, policy.typical_prefill_s = 2.0, 1.0  # as if tracked
    picks = {
        "p-a": PrefillPick("p-a", 40_000, 0.04, 2.1),  # cached: 2.06 s of queue
        "p-b": PrefillPick("p-b", 0, 0.74, 0.8),  # quickest: 0.06 s of queue
        "p-c": PrefillPick("p-c", 0, 0.74, 1.5),  # 0.76 s
        "p-d": PrefillPick("p-d", 0, 0.74, 0.9),  # 0.16 s
    }
    ctx = PickContext(request(40_000), 0.0, LoadView(COST), GlobalKVIndex())
    # every worker has some queue (busy 1: the recompute weight, 30, prices the 0.70 s saved at 21 s), but only p-a
    # and p-c one past 0.5 s: the price is 0.5 / (1 - 0.5) = 1, 0.70 s against the 1.3 s p-a's wait adds
    assert sorted(policy.scores(ctx, picks)) == ["p-b", "p-c", "p-d"]
    policy.queued_typical = 0.0  # any queue counts: the price is the weight, and p-a's wait pays
    assert sorted(policy.scores(ctx, picks)) == ["p-a", "p-b", "p-c", "p-d"]


def test_kvmesh_decode_predicts_kv_when_the_request_arrives() -> None:
    view = LoadView(COST)
    policy = KvmeshDecode(expected_output_tokens=100)  # lifetime: 100 steps of 0.01 s
    d_a, d_b = worker("d-a", num_kv_tokens=1000), worker("d-b", num_kv_tokens=500)
    view.update(d_a)
    view.update(d_b)
    view.assign(Assignment("b", "r1", 0.0, "p-a", "d-b", 300, 300, 0.3, 0.2))  # on d-b at 0.2
    view.assign(Assignment("b", "r2", 0.0, "p-a", "d-b", 900, 900, 0.9, 0.8))  # on d-b at 0.8
    # at 0.5: the reports' KV decays with the expected lifetime; r1 is there, r2 not yet
    assert policy.predicted_kv(d_a, view, 0.0, 0.5) == pytest.approx(1000 * math.exp(-0.5))
    assert policy.predicted_kv(d_b, view, 0.0, 0.5) == pytest.approx(500 * math.exp(-0.5) + 300 * math.exp(-0.3))
    assert policy.pick(request(10), [d_a, d_b], view, 0.0, arrival_s=0.5) == "d-b"  # 606.5 against 525.5
    assert policy.pick(request(10), [d_a, d_b], view, 0.0, arrival_s=0.9) == "d-a"  # r2 counts by then: 1166.6
    policy.observe_output(200)
    assert policy.expected_output_tokens == pytest.approx(101.0)


def test_finished_requests_heard_from_decode_free_their_kv_before_the_next_report() -> None:
    view = LoadView(COST)
    policy = KvmeshDecode(expected_output_tokens=100)  # lifetime: 100 steps of 0.01 s
    d_a = worker("d-a", num_kv_tokens=1000, num_running=2)
    d_b = worker("d-b", num_kv_tokens=700, num_running=1)
    view.update(d_a)
    view.update(d_b)
    view.assign(Assignment("b", "r1", 0.0, "p-a", "d-b", 300, 300, 0.3, 0.1))  # on d-b at 0.1
    assert policy.pick(request(10), [d_a, d_b], view, 0.3, arrival_s=0.5) == "d-b"  # no feed yet: decays from 0
    view.finish("d-a", "old", 0.1, 600)  # one of d-a's two left at 0.1 with 600 tokens of KV
    view.finish("d-b", "r1", 0.2, 310)  # r1 came and went between reports: it just stops counting
    view.finish("d-b", "gone", -1.0, 50)  # before d-b's report: the report shows it gone already
    assert view.num_finished("d-a") == (1, 600) and view.num_finished("d-b") == (0, 0)
    assert view.num_kv_tokens(d_a) == 400 and view.num_requests(d_a) == 1
    assert view.num_kv_tokens(d_b) == 700 and view.num_requests(d_b) == 1
    # known up to now: 400 left on d-a; the one still running grows a token per 0.01 s step from the report on, read
    # over the window after the arrival at 0.5 (half of 100 expected outputs' steps: to 1.0) at 0.5, 0.625, ..., 1.0
    assert policy.predicted_kv(d_a, view, 0.3, 0.5) == pytest.approx(400 + (50 + 62.5 + 75 + 87.5 + 100) / 5)
    view.assign(Assignment("b", "r3", 0.3, "p-a", "d-b", 100, 100, 0.1, 0.9))  # on d-b later, but it counts
    # from when it gets there (0.9: only the window's last moment, 1.0), with the 10 tokens it has made by then
    assert policy.predicted_kv(d_b, view, 0.3, 0.5) == pytest.approx(700 + 75 + (100 + 10) / 5)
    assert policy.pick(request(10), [d_a, d_b], view, 0.3, arrival_s=0.5) == "d-a"
    view.update(worker("d-a", reported_s=0.25, num_kv_tokens=420, num_running=1))  # a report after the finish
    assert view.num_finished("d-a") == (0, 0)


# -- the Router -----------------------------------------------------------------------------------------------------


def test_excluded_workers_are_skipped_and_an_empty_pool_names_the_model() -> None:
    router = Router("kvmesh", GlobalKVIndex(), COST)
    route, _ = router.route(request(32, 1, exclude=("p-a", "p-b", "d-a")), PREFILL, DECODE, 0.0)
    assert (route.prefill_worker_id, route.decode_worker_id) == ("p-c", "d-b")
    with pytest.raises(NoWorkerError, match=r"^no prefill worker serves model 'm'$"):
        router.route(request(16), [], DECODE, 0.0)
    with pytest.raises(NoWorkerError, match=r"^no decode worker serves model 'm' \(1 excluded\)$"):
        router.route(request(16, exclude=("d-a",)), PREFILL, DECODE[:1], 0.0)
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        Router("fastest", GlobalKVIndex())


def test_replicas_count_each_others_assignments_but_not_their_own_twice() -> None:
    one, two = (Router("least_load", GlobalKVIndex(), COST, balancer_id=f"balancer-{n}") for n in (1, 2))
    pool = [worker("p-a"), worker("p-b")]
    _, assignment = one.route(request(500), pool, DECODE, 0.0)
    assert assignment.prefill_worker_id == "p-a"
    one.apply(assignment)  # its own, heard back from NATS: already counted
    assert one.view.num_queued_tokens(pool[0]) == 500
    assert two.route(request(500), pool, DECODE, 0.0)[0].prefill_worker_id == "p-a"  # not heard yet: herds
    two.apply(assignment)
    assert two.view.num_queued_tokens(pool[0]) == 1000
    assert two.route(request(500), pool, DECODE, 0.0)[0].prefill_worker_id == "p-b"
