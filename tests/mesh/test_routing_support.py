"""What the routing policies stand on, with exact values: the cost model, the LoadView's optimistic accounting and
queue prediction, the global index's per-worker and store-tier prefix walks, the encoder pool's policy and the
capacity planner."""

from __future__ import annotations

import pytest

from mesh.kv_index import GlobalKVIndex
from mesh.pb import events_pb2
from mesh.routing import Assignment, CostModel, WorkerState
from mesh.routing.calibration import TimeScale
from mesh.routing.capacity import CapacityPlanner
from mesh.routing.encoder import EncoderBalancer, pick_encoder, rendezvous_rank
from mesh.routing.view import LoadView

COST = CostModel(
    prefill_tokens_per_s=1000.0,
    prefill_overhead_s=0.0,
    attention_knee_tokens=1000.0,
    kv_bytes_per_token=1000,
    host_bytes_per_s=1e6,
    ssd_bytes_per_s=5e5,
    network_bytes_per_s=1e6,
    decode_step_base_s=0.01,
    decode_s_per_kv_token=1e-5,
    scale=2.0,
)


def k(i: int) -> bytes:
    return bytes([i]) * 32


def assignment(
    prefill: str, decode: str, tokens: int, prefill_s: float, at_s: float = 0.0, arrival_s: float = 1.0
) -> Assignment:
    return Assignment("b", "r", at_s, prefill, decode, tokens, tokens, prefill_s, arrival_s)


def test_cost_model() -> None:
    assert COST.prefill_s(0, 1000) == pytest.approx(1.0 * 1.5 * 2)  # mean depth 500 over a knee of 1000, scale 2
    assert COST.prefill_s(1000, 100) == pytest.approx(0.1 * 2.05 * 2)
    assert (COST.fetch_s(100, "device"), COST.fetch_s(100, "host"), COST.fetch_s(100, "ssd")) == (0.0, 0.1, 0.2)
    assert COST.transfer_s(500) == 0.5
    assert COST.decode_step_s(1000) == pytest.approx((0.01 + 0.01) * 2)
    assert COST.queued_s(300) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be positive"):
        CostModel(prefill_tokens_per_s=0)


def test_view_counts_assignments_until_a_report_includes_them() -> None:
    view = LoadView(COST)
    view.update(WorkerState("p-a", 0.0, num_queued_prompt_tokens=100))
    view.assign(assignment("p-a", "d-a", 200, 0.5, at_s=1.0, arrival_s=3.0))
    view.assign(assignment("p-a", "d-a", 100, 0.25, at_s=2.0, arrival_s=4.0))
    p_a = view.report("p-a")
    assert p_a is not None and (view.num_queued_tokens(p_a), view.num_requests(p_a)) == (400, 2)
    # the queue reported at 0 (100 tokens at the shallow rate: 0.2 s) is done at 0.2; then 1.0 -> 1.5, 2.0 -> 2.25
    assert view.wait_s(p_a, 2.0) == pytest.approx(0.25) and view.wait_s(p_a, 3.0) == 0.0
    d_a = WorkerState("d-a", 3.5, num_kv_tokens=50)
    view.update(d_a)  # has the first request's KV (there at 3.0), not the second's (4.0)
    assert view.num_kv_tokens(d_a) == 150
    view.update(WorkerState("p-a", 2.1, num_queued_prompt_tokens=150))
    p_a = view.report("p-a")
    assert p_a is not None and view.num_queued_tokens(p_a) == 150
    # 150 queued tokens are the last assignments the report included, newest first: 100 tokens of 0.25 s, then
    # 50 of the 200-token one's 0.5 s
    assert view.wait_s(p_a, 2.1) == pytest.approx(0.25 + 0.125)
    assert view.recent_work_s("p-a", 2.0) == pytest.approx(0.5 * 2 ** (-1 / 120) + 0.25)


def test_a_late_peer_assignment_keeps_the_pending_entries_in_order() -> None:
    view = LoadView(COST)
    view.assign(assignment("p-a", "d-a", 10, 0.1, at_s=2.0))
    view.assign(assignment("p-a", "d-a", 20, 0.1, at_s=1.0))  # heard late
    assert [entry[1] for entry in view.pending("p-a")] == [20, 10]
    view.update(WorkerState("p-a", 1.5))
    assert [entry[1] for entry in view.pending("p-a")] == [10]


def test_index_walks_every_workers_prefix_and_the_stores_tiers() -> None:
    index = GlobalKVIndex()
    index.add("p-a", [k(1), k(2), k(3)])
    index.add("p-b", [k(1), k(3)])
    index.add("p-c", [k(2)])
    assert index.leading_hits_by_worker([k(1), k(2), k(3), k(4)]) == {"p-a": 3, "p-b": 1}
    assert index.leading_hits_by_worker([k(2), k(3)]) == {"p-a": 2, "p-c": 1}
    assert index.leading_hits_by_worker([k(1)], tier="host") == {}
    assert index.holds("p-b", k(3)) and not index.holds("p-b", k(2))
    index.add("kv-0", [k(4), k(5)], tier="host")
    index.add("kv-1", [k(6)], tier="ssd")
    coded = events_pb2.KVBlocksStored(block_hashes=[k(7)], fragment_indices=[0], num_data_fragments=2, num_fragments=3)
    index.apply(
        events_pb2.KVEventBatch(worker_id="kv-0", seq=9, tier="host", events=[events_pb2.KVEvent(stored=coded)])
    )
    blocks = [k(1), k(2), k(3), k(4), k(5), k(6), k(7)]
    assert index.num_leading_stored(blocks, 3) == (2, 1)  # k(7): 1 of the 2 fragments it needs
    coded.fragment_indices[:] = [1]
    index.apply(
        events_pb2.KVEventBatch(worker_id="kv-1", seq=10, tier="ssd", events=[events_pb2.KVEvent(stored=coded)])
    )
    assert index.num_leading_stored(blocks, 3) == (2, 2)  # k(7) readable from host + SSD fragments: SSD speed
    assert index.num_leading_stored(blocks, 0) == (0, 0)


def test_pick_encoder_prefers_a_cached_embedding_then_the_images_home_within_a_bound() -> None:
    workers = [WorkerState(f"e-{n}", 0.0) for n in range(3)]
    image = b"image-1"
    home = max(workers, key=lambda w: rendezvous_rank(image, w.worker_id)).worker_id
    assert pick_encoder(workers, image) == home
    other = next(w.worker_id for w in workers if w.worker_id != home)
    assert pick_encoder(workers, image, cached_worker_ids={other}) == other
    busy = [WorkerState(w.worker_id, 0.0, num_waiting=3 if w.worker_id == home else 0) for w in workers]
    least = min(w.worker_id for w in workers if w.worker_id != home)
    assert pick_encoder(busy, image) == least  # 3 > 0 + 2
    assert pick_encoder(busy, image, max_extra_images=3) == home
    with pytest.raises(ValueError, match="no encoder worker"):
        pick_encoder([], image)


def test_encoder_balancer_counts_its_images_until_the_next_report() -> None:
    workers = [WorkerState(f"e-{n}", 0.0) for n in range(3)]
    image = b"image-2"
    home = max(workers, key=lambda w: rendezvous_rank(image, w.worker_id)).worker_id
    first_other = min(w.worker_id for w in workers if w.worker_id != home)
    balancer = EncoderBalancer(max_extra_images=2)
    assert [balancer.pick(workers, image) for _ in range(4)] == [home, home, home, first_other]
    reported = [WorkerState(w.worker_id, 1.0) for w in workers]  # the reports include (or finished) them
    assert balancer.pick(reported, image) == home


def test_capacity_planner_recommends_the_pool_size_for_the_target_utilization() -> None:
    planner = CapacityPlanner(target_utilization=0.8, half_life_s=60.0)
    assert planner.recommend("prefill", 4).num_recommended == 1  # nothing observed yet
    prefill = [
        WorkerState("p-a", 0.0, num_running=1),
        WorkerState("p-b", 0.0, num_queued_prompt_tokens=5),
        WorkerState("p-c", 0.0),
        WorkerState("p-d", 0.0),
    ]
    planner.observe("prefill", prefill, 0.0)
    assert planner.recommend("prefill", 4).num_recommended == 3  # 4 x 0.5 / 0.8 = 2.5
    planner.observe("prefill", [WorkerState(w.worker_id, 60.0, num_running=1) for w in prefill], 60.0)
    recommendation = planner.recommend("prefill", 4)
    assert (recommendation.utilization, recommendation.num_recommended) == (0.75, 4)  # half-way to 1.0
    decode = [
        WorkerState("d-a", 0.0, block_size=16, max_num_seqs=8, num_kv_blocks=100, num_running=2, kv_usage=0.5),
        WorkerState("d-b", 0.0, max_num_seqs=8, num_running=6),
    ]
    planner.observe("decode", decode, 0.0)  # max(0.5 KV, 0.25 seqs) and 0.75 seqs
    assert planner.recommend("decode", 2).num_recommended == 2  # 2 x 0.625 / 0.8 = 1.5625
    with pytest.raises(ValueError, match="target_utilization"):
        CapacityPlanner(target_utilization=0)


def test_time_scale_fits_real_to_predicted_seconds_only_from_intervals_all_work() -> None:
    scale = TimeScale()
    for n in range(3):  # 0.2 model seconds done in every 1 s: 5x slower; far off, 2x per sample at most
        scale.observe(10.0 * n, 1.0, [(10.0 * n + 0.1, 1.0)], 10.0 * n + 1, 1.8, True)
    fitted = 4 * 1.25**0.2  # 2, 4, then within 2x of the sample: a fifth of the way, in log space
    assert (scale.value, scale.num_samples) == (pytest.approx(fitted), 3)
    scale.observe(40.0, 1.0, [(40.5, 1.0)], 41.0, 1.75, True)  # 0.25 done in 1 s: 4x
    assert scale.value == pytest.approx(fitted * (4 / fitted) ** 0.2)
    before = scale.value
    scale.observe(50.0, 0.1, [(50.9, 1.0)], 51.0, 0.5, True)  # idle from 50.4 to 50.9 perhaps: no sample
    scale.observe(60.0, 0.1, [], 61.0, 0.0, False)  # predicted done at 60.4 and done: how early is unknown
    scale.observe(70.0, 0.0, [], 71.0, 0.0, False)  # nothing to do
    assert (scale.value, scale.num_samples) == (before, 4)
