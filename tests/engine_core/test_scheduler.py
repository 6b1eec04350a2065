"""The scheduler driven without a model: each step 'samples' a fixed token for the requests that need one."""

from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import RequestStatus
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import Scheduler, SchedulerConfig

from .helpers import make_request

TOKEN = 7


def make_scheduler(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, long_prefill_threshold=0):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, long_prefill_threshold), kv)


def step(scheduler):
    output = scheduler.schedule()
    sampled = {s.request.request_id: TOKEN for s in output.scheduled if s.needs_sample}
    return output, scheduler.update(output, sampled)


def plan(output):
    return [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", list(range(20)), SamplingParams(max_tokens=2)))
    first, results = step(scheduler)
    assert plan(first) == [("a", 8)] and results == []
    second, results = step(scheduler)
    assert plan(second) == [("a", 8)] and results == []
    third, results = step(scheduler)
    assert plan(third) == [("a", 4)]
    assert [r.new_token_ids for r in results] == [[TOKEN]]
    fourth, results = step(scheduler)
    assert plan(fourth) == [("a", 1)] and results[0].finished and results[0].finish_reason == "length"
    assert scheduler.kv.pool.num_free_blocks == 32


def test_decodes_come_first_and_waiting_requests_share_the_rest_of_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", list(range(5)), SamplingParams(max_tokens=8)))
    step(scheduler)
    scheduler.add_request(make_request("b", list(range(100, 120)), SamplingParams(max_tokens=8)))
    scheduler.add_request(make_request("c", list(range(200, 204)), SamplingParams(max_tokens=8)))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1), ("b", 9)]  # c waits: the budget is spent
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1), ("b", 9)]
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1), ("b", 2), ("c", 4)]


def test_an_earlier_chunked_prefill_leaves_a_token_for_each_later_decode():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("long", list(range(40)), SamplingParams(max_tokens=2)))
    scheduler.add_request(make_request("b", [1, 2], SamplingParams(max_tokens=8)))
    scheduler.add_request(make_request("c", [3, 4], SamplingParams(max_tokens=8)))
    scheduler.running.extend(scheduler.waiting)  # all three running, "long" first (the earliest arrival)
    scheduler.waiting.clear()
    for request in scheduler.running:
        request.status = RequestStatus.RUNNING
    scheduler.kv.allocate_slots(scheduler.requests["b"], 1)
    scheduler.kv.allocate_slots(scheduler.requests["c"], 1)
    scheduler.requests["b"].num_computed_tokens = scheduler.requests["c"].num_computed_tokens = 1  # decoding
    output, _ = step(scheduler)
    assert plan(output) == [("b", 1), ("c", 1), ("long", 6)]  # before: [("long", 8)], b and c stalled


def test_while_requests_decode_prefills_keep_under_the_long_prefill_threshold():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_threshold=5)
    scheduler.add_request(make_request("a", list(range(3)), SamplingParams(max_tokens=20)))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 3)]  # nothing decodes yet: no cap
    scheduler.add_request(make_request("long", list(range(100, 112)), SamplingParams(max_tokens=2)))
    scheduler.add_request(make_request("next", list(range(200, 204)), SamplingParams(max_tokens=2)))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1), ("long", 5)]  # "next" waits: the prefill cap is spent
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1), ("long", 5)]
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1), ("long", 2), ("next", 3)]  # both prefills share the cap
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1), ("long", 1), ("next", 1)]


def test_max_num_seqs_bounds_the_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, [1, 2, 3], SamplingParams(max_tokens=3)))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 3), ("b", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_running_out_of_blocks_preempts_the_latest_arrival_which_resumes_from_the_cache():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("a", list(range(7)), SamplingParams(max_tokens=6, ignore_eos=True)))
    scheduler.add_request(make_request("b", list(range(50, 57)), SamplingParams(max_tokens=6, ignore_eos=True)))
    output, _ = step(scheduler)  # a: blocks 0,1; b: blocks 2,3
    assert plan(output) == [("a", 7), ("b", 7)]
    assert scheduler.kv.block_ids("a") == [0, 1] and scheduler.kv.block_ids("b") == [2, 3]
    output, _ = step(scheduler)  # positions 7: both still fit in 8 tokens
    assert plan(output) == [("a", 1), ("b", 1)]
    output, _ = step(scheduler)  # a needs a 3rd block: b (the later arrival) is preempted for it
    assert output.preempted_ids == ("b",) and plan(output) == [("a", 1)]
    # b's blocks were freed tail first, so a takes b's second block and b's first stays cached
    assert scheduler.kv.block_ids("a") == [0, 1, 3]
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(scheduler.waiting) == [b]
    while "a" in scheduler.requests:
        step(scheduler)
    assert scheduler.requests.get("a") is None  # finished and forgotten
    output, _ = step(scheduler)
    # b resumes: its first full block (tokens 50..53) is still cached (block 2), so 9 - 4 tokens are recomputed
    assert plan(output) == [("b", 5)] and b.num_computed_tokens == 9
    assert scheduler.kv.block_ids("b")[0] == 2
    while scheduler.has_unfinished():
        step(scheduler)
    assert b.output_token_ids == [TOKEN] * 6 and scheduler.num_preemptions == 1


def test_many_requests_on_few_blocks_all_finish_without_deadlock():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=16)
    for i in range(10):
        scheduler.add_request(make_request(f"r{i}", [i] * (3 + i), SamplingParams(max_tokens=5, ignore_eos=True)))
    finished = []
    for _ in range(500):
        _, results = step(scheduler)
        finished += [r.request_id for r in results if r.finished]
        if not scheduler.has_unfinished():
            break
    assert sorted(finished) == sorted(f"r{i}" for i in range(10))
    assert finished[0] == "r0"  # the oldest request is never starved
    assert scheduler.kv.pool.num_free_blocks == 6


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2], SamplingParams(max_tokens=5), eos=(TOKEN,)))
    scheduler.add_request(make_request("b", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), eos=(TOKEN,)))
    scheduler.add_request(make_request("c", [1, 2], SamplingParams(max_tokens=5, min_tokens=2), eos=(TOKEN,)))
    _, results = step(scheduler)
    assert {r.request_id: r.finish_reason for r in results} == {"a": "stop", "b": None, "c": None}
    _, results = step(scheduler)
    assert {r.request_id: r.finish_reason for r in results} == {"b": None, "c": "stop"}
    _, results = step(scheduler)
    assert {r.request_id: r.finish_reason for r in results} == {"b": "length"}


def test_abort_frees_blocks_and_reports_the_finish_once():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", list(range(9)), SamplingParams(max_tokens=5)))
    step(scheduler)
    assert scheduler.kv.pool.num_free_blocks == 29
    assert scheduler.abort("a") is True and scheduler.abort("a") is False
    assert scheduler.kv.pool.num_free_blocks == 32
    _, results = step(scheduler)
    assert [(r.request_id, r.finish_reason) for r in results] == [("a", "abort")]
    assert not scheduler.has_unfinished()


def test_a_request_s_queue_time_ends_at_its_first_scheduling_and_comes_with_its_outputs():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
    scheduler.add_request(make_request("b", [4, 5, 6], SamplingParams(max_tokens=2)))
    _, first = step(scheduler)
    a_at = scheduler.requests["a"].first_scheduled_at
    assert a_at is not None and scheduler.requests["b"].first_scheduled_at is None  # b waits: the batch is full
    assert [(r.request_id, r.first_scheduled_at) for r in first] == [("a", a_at)]
    _, second = step(scheduler)  # a finishes
    assert [(r.request_id, r.finished, r.first_scheduled_at) for r in second] == [("a", True, a_at)]
    _, third = step(scheduler)
    b_at = scheduler.requests["b"].first_scheduled_at
    assert b_at is not None and b_at > a_at
    assert [(r.request_id, r.first_scheduled_at) for r in third] == [("b", b_at)]
