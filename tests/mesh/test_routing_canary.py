"""A rollout's split (mesh.routing.canary): buckets sticky per tenant and conversation, the share the weight says,
the Router routing each side to its version's workers, and neither side ever left without a worker."""

from __future__ import annotations

import pytest

from mesh.kv_index import GlobalKVIndex
from mesh.routing import Router, RouteRequest, Split, WorkerState
from mesh.routing.canary import STICKY_BLOCKS, bucket, is_canary_request, side_of


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def conversation(i: int, turn: int = 0, tenant: str = "acme") -> RouteRequest:
    """Turn `turn` of conversation `i`: one system prompt's block, then the conversation's own, STICKY_BLOCKS of them
    at least, more each turn."""
    blocks = (key(999_999), *(key(i * 1000 + b) for b in range(STICKY_BLOCKS + turn)))
    return RouteRequest("m", blocks, 16 * len(blocks), request_id=f"r{i}-{turn}", tenant=tenant)


def worker(worker_id: str, version: str) -> WorkerState:
    return WorkerState(worker_id, 0.0, block_size=16, max_num_seqs=8, num_kv_blocks=100, version=version)


PREFILL = [worker("p-a", "1.0"), worker("p-b", "1.0"), worker("p-c", "2.0")]
DECODE = [worker("d-a", "1.0"), worker("d-b", "2.0")]


def test_a_conversation_keeps_its_bucket_over_turns_and_tenants_get_their_own():
    shared_prefix = [RouteRequest("m", (key(999_999),) * 3 + (key(n),), 64, tenant="acme") for n in range(50)]
    assert len({bucket(r) for r in shared_prefix}) > 30  # one system prompt does not put everyone on one side
    assert [bucket(conversation(i)) for i in range(5)] == [bucket(conversation(i, turn=3)) for i in range(5)]
    assert [bucket(conversation(i)) for i in range(5)] == [27, 77, 98, 35, 70]
    assert [bucket(conversation(i, tenant="globex")) for i in range(5)] == [93, 47, 52, 52, 58]
    short = RouteRequest("m", (), 5, request_id="short-1", tenant="acme")  # no full block: its request id
    assert bucket(short) == bucket(RouteRequest("m", (), 9, request_id="short-1", tenant="acme")) == 91


@pytest.mark.parametrize(("weight", "num_canary"), [(0, 0), (5, 48), (25, 258), (50, 508), (100, 1000)])
def test_the_weight_is_the_share_of_conversations_on_the_canary(weight: int, num_canary: int):
    split = Split("m", "2.0", weight)
    assert sum(is_canary_request(split, conversation(i)) for i in range(1000)) == num_canary


def test_the_router_sends_each_side_to_its_versions_workers():
    router = Router("least_load", GlobalKVIndex())
    router.splits["m"] = Split("m", "2.0", 25)
    for i in range(40):
        route, _ = router.route(conversation(i), PREFILL, DECODE, now_s=0.0)
        if is_canary_request(router.splits["m"], conversation(i)):
            assert (route.prefill_worker_id, route.decode_worker_id) == ("p-c", "d-b")
        else:
            assert route.prefill_worker_id in ("p-a", "p-b") and route.decode_worker_id == "d-a"
    other = Router("least_load", GlobalKVIndex())
    other.splits["other-model"] = Split("other-model", "2.0", 100)  # another model's rollout changes nothing here
    assert {other.route(conversation(i), PREFILL, DECODE, 0.0)[0].decode_worker_id for i in range(4)} == {"d-a", "d-b"}


def test_neither_side_is_ever_left_without_a_worker():
    all_canary, no_canary = Split("m", "2.0", 100), Split("m", "2.0", 0)
    request = conversation(1)
    assert [w.worker_id for w in side_of(all_canary, request, PREFILL)] == ["p-c"]
    assert [w.worker_id for w in side_of(no_canary, request, PREFILL)] == ["p-a", "p-b"]
    stable_only = [worker("p-a", "1.0"), worker("p-b", "1.0")]  # the canary has no capacity: stable serves
    assert [w.worker_id for w in side_of(all_canary, request, stable_only)] == ["p-a", "p-b"]
    excluded = RouteRequest("m", request.block_hashes, 16, "retry", frozenset({"p-c"}), tenant="acme")
    assert [w.worker_id for w in side_of(all_canary, excluded, PREFILL)] == ["p-a", "p-b"]
    promoted = [worker("p-c", "2.0")]  # the stable workers are gone after a promotion
    assert [w.worker_id for w in side_of(no_canary, request, promoted)] == ["p-c"]


def test_a_split_names_a_canary_version_and_a_weight_from_0_to_100():
    with pytest.raises(ValueError, match=r"^weight must be from 0 to 100, got 101$"):
        Split("m", "2.0", 101)
    with pytest.raises(ValueError, match=r"^canary_version is required$"):
        Split("m", "", 5)
