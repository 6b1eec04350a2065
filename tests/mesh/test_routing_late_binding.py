"""Late binding (mesh.routing.Router with decode_binding="late"): Route names the prefill worker only, and
`bind_decode` picks the decode worker when the KV is ready, with the same decode policy and view; both halves are
shared with peer replicas as Assignments, and a rollout's binding keeps the side the route chose."""

from __future__ import annotations

import pytest

from mesh.kv_index import GlobalKVIndex
from mesh.routing import Router, RouteRequest, Split, WorkerState
from tests.mesh.test_routing_canary import conversation
from tests.mesh.test_routing_policies import COST, DECODE, PREFILL, request, worker


def late(policy: str = "kvmesh", balancer_id: str = "") -> Router:
    return Router(policy, GlobalKVIndex(), COST, balancer_id, decode_binding="late")


def test_a_late_route_names_prefill_only_and_counts_nothing_on_decode() -> None:
    router = late()
    route, assignment = router.route(request(500, 1, 2, request_id="r1"), PREFILL, DECODE, 0.0)
    assert (route.prefill_worker_id, route.decode_worker_id) == ("p-c", "")  # idle ties spread by request id
    assert (assignment.prefill_worker_id, assignment.decode_worker_id) == ("p-c", "")
    assert router.view.num_pending_tokens("p-c") == 500
    assert [router.view.num_pending(w.worker_id) for w in DECODE] == [0, 0]
    assert router.view.num_pending("") == 0  # no worker named "" holds the missing half
    with pytest.raises(Exception, match="no decode worker serves model 'm'"):
        router.route(request(500), PREFILL, [], 0.0)  # no decode pool: nothing is computed for nobody


def test_bind_decode_picks_with_the_decode_policy_and_counts_on_decode_only() -> None:
    router = late("kv_aware")  # least KV tokens
    decode = [worker("d-a", num_kv_tokens=300), worker("d-b", num_kv_tokens=200)]
    router.route(request(500, request_id="r1"), PREFILL, decode, 0.0)
    decode_id, assignment = router.bind_decode(RouteRequest("m", (), 500, "r1"), decode, 2.0)
    assert decode_id == "d-b"
    # the KV's 500 tokens at 1 ms each: there at 2.5 s
    assert (assignment.prefill_worker_id, assignment.decode_worker_id, assignment.decode_arrival_s) == ("", "d-b", 2.5)
    assert (assignment.num_prompt_tokens, assignment.num_uncached_tokens, assignment.prefill_s) == (500, 0, 0.0)
    assert router.view.num_kv_tokens(decode[1]) == 700
    assert router.view.num_pending_tokens("p-a") == 500  # the route's, not counted twice
    assert router.bind_decode(RouteRequest("m", (), 100, "r2"), decode, 2.0)[0] == "d-a"  # 300 < 700 now
    excluded = RouteRequest("m", (), 100, "r3", frozenset({"d-a"}))
    assert router.bind_decode(excluded, decode, 2.0)[0] == "d-b"
    with pytest.raises(ValueError, match="must not be negative"):
        router.bind_decode(RouteRequest("m", (), -1, "r4"), decode, 2.0)


def test_choosing_when_the_kv_is_ready_sees_what_left_since_the_arrival() -> None:
    """At the arrival d-a holds more KV; by the time the KV is ready, d-a's request finished (the decode feed):
    early binding chose d-b, late binding takes the now empty d-a."""
    decode = [worker("d-a", num_running=1, num_kv_tokens=1000), worker("d-b", num_running=1, num_kv_tokens=600)]
    early = Router("kvmesh", GlobalKVIndex(), COST)
    assert early.route(request(100, request_id="r1"), PREFILL, decode, 0.0)[0].decode_worker_id == "d-b"
    router = late()
    assert router.route(request(100, request_id="r1"), PREFILL, decode, 0.0)[0].decode_worker_id == ""
    router.observe_finished("d-a", "old", 0.5, 1000, 40)
    assert router.bind_decode(RouteRequest("m", (), 100, "r1"), decode, 1.0)[0] == "d-a"


def test_peers_apply_both_halves_of_a_late_decision() -> None:
    one, two = late("least_load", "balancer-1"), late("least_load", "balancer-2")
    _, routed = one.route(request(500, request_id="r1"), PREFILL, DECODE, 0.0)
    _, bound = one.bind_decode(RouteRequest("m", (), 500, "r1"), DECODE, 1.0)
    assert bound.decode_worker_id == "d-a"
    for assignment in (routed, bound):
        two.apply(assignment)
    assert two.view.num_pending_tokens("p-a") == 500 and two.view.num_pending_tokens("d-a") == 500
    assert two.view.num_pending("") == 0
    assert two.bind_decode(RouteRequest("m", (), 500, "r2"), DECODE, 1.0)[0] == "d-b"  # d-a has r1 coming


def test_during_a_rollout_the_binding_keeps_the_side_the_route_chose() -> None:
    """A canary of decode workers only (the prefill pool all stable): a canary conversation's route says so, and
    its binding goes to the canary decode worker though it holds more KV; a stable one's does not."""
    prefill = [WorkerState("p-a", 0.0, 16, 8, 100, version="1.0")]
    decode = [
        WorkerState("d-new", 0.0, 16, 8, 100, num_kv_tokens=900, version="2.0"),
        WorkerState("d-old", 0.0, 16, 8, 100, version="1.0"),
    ]
    router = late("kv_aware")
    router.splits["m"] = Split("m", "2.0", weight=50)
    canary, stable = conversation(0), conversation(1)  # buckets 27 and 77 (test_routing_canary.py)
    assert [router.route(r, prefill, decode, 0.0)[0].is_canary for r in (canary, stable)] == [True, False]
    kv = RouteRequest("m", (), 100, "r1")
    assert router.bind_decode(kv, decode, 0.0, is_canary=True)[0] == "d-new"
    assert router.bind_decode(kv, decode, 0.0, is_canary=False)[0] == "d-old"
    only_new = RouteRequest("m", (), 100, "r2", frozenset({"d-old"}))
    assert router.bind_decode(only_new, decode, 0.0, is_canary=False)[0] == "d-new"  # its side has nobody
    del router.splits["m"]
    assert router.bind_decode(kv, decode, 0.0, is_canary=True)[0] == "d-old"  # no rollout: by KV alone


def test_an_unknown_binding_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown decode binding 'lazy': expected one of early, late"):
        Router("kvmesh", GlobalKVIndex(), decode_binding="lazy")
