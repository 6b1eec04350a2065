"""The prefill budget priced from step times: fed exact step costs, it must hand out exact chunk sizes."""

import dataclasses
import math

import pytest

from engine_core.config import ConfigError, EngineConfig, MLAConfig, ModelConfig
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.prefill_budget import (
    DECODE_WINDOW_STEPS,
    MACS_PER_FLOAT_READ,
    MIN_CHUNK_TOKENS,
    NUM_PREFILL_STEPS,
    REFRESH_STEPS,
    PrefillBudget,
    PrefillShape,
)
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import Scheduler, SchedulerConfig
from mesh.compute.settings import WorkerSettings
from mesh.config import load_settings

from .helpers import make_request

# round numbers: a token's attention costs its linear layers at 1,000 tokens of context, a read of 500 cached ones
SHAPE = PrefillShape(span=1000.0, read_span=500.0)
DECODE_MS = 100.0


def measured_budget(ms_per_work: float, ratio: float = 2.0, num_prefill_steps: int = 1) -> PrefillBudget:
    """A budget that saw decode-only steps of DECODE_MS and prefill steps priced at `ms_per_work`."""
    budget = PrefillBudget(ratio, SHAPE)
    for _ in range(3):
        budget.observe(8, [], DECODE_MS)
    for _ in range(num_prefill_steps):
        budget.observe(8, [(0, 8)], DECODE_MS + ms_per_work * SHAPE.work(0, 8))
    return budget


SMOLLM2 = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
}
# per layer: q, o (576 x 576 each), k, v (576 x 192 each), gate, up, down (576 x 1536 each)
SMOLLM2_LINEAR = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536


def test_the_spans_of_smollm2_follow_its_shape():
    shape = PrefillShape.of(ModelConfig.from_hf(SMOLLM2))
    assert shape.span == SMOLLM2_LINEAR / (2 * 9 * 64) == 3072.0  # q.k and p.v over one more key, 9 heads of 64
    assert shape.read_span == SMOLLM2_LINEAR / (2 * 3 * 64 * MACS_PER_FLOAT_READ) == 288.0  # K and V, 3 heads of 64


def test_an_mla_model_reads_its_latent():
    config = dataclasses.replace(
        ModelConfig.from_hf(SMOLLM2),
        mla=MLAConfig(
            None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=False
        ),
    )
    assert PrefillShape.of(config).read_span == SMOLLM2_LINEAR / ((512 + 64) * MACS_PER_FLOAT_READ)


def test_work_counts_tokens_their_attention_pairs_and_one_read_of_the_context():
    assert SHAPE.work(0, 8) == 8 + 36 / 1000  # pairs 1 + 2 + ... + 8, nothing cached to read
    assert SHAPE.work(4000, 8) == 8 + (32_000 + 36) / 1000 + 4000 / 500  # the same chunk late in a long prompt: 6x
    assert SHAPE.work(4000, 8) - SHAPE.work(4000, 1) == 7 + (28_000 + 35) / 1000  # the read is paid once a chunk
    assert SHAPE.work(4000, 0) == 0.0  # no chunk, no read


def test_unmeasured_prefills_get_the_floor_and_only_the_first():
    allowance = PrefillBudget(2.0, SHAPE).allowance()
    assert allowance.take(0, 500) == MIN_CHUNK_TOKENS == 2
    assert allowance.take(0, 500) == 0
    decoded_only = PrefillBudget(2.0, SHAPE)
    decoded_only.observe(8, [], DECODE_MS)  # the decode step is known, the price of prefill not yet
    assert decoded_only.allowance().take(0, 500) == 2


def test_chunks_shrink_as_the_prompt_goes_on():
    budget = measured_budget(ms_per_work=2.0)  # ratio 2: 100 ms of prefill a step, 50 token-equivalents
    assert (budget.decode_ms, budget.ms_per_work) == (DECODE_MS, pytest.approx(2.0))
    # the largest n with n + (n c + n (n + 1) / 2) / 1000 + c / 500 <= 50
    assert budget.allowance().take(0, 500) == 48  # 49.176; 49 would be 50.225
    assert budget.allowance().take(2000, 500) == 15  # 4 + 3 n: 49.12; 16 would be 52.136
    assert budget.allowance().take(8000, 500) == 3  # 16 + 9 n: 43.006; 4 would be 52.01
    assert budget.allowance().take(50_000, 500) == 2  # the read alone (100) is over: the floor gives 2
    assert budget.allowance().take(2000, 10) == 10  # what is left of the prompt


def test_small_chunks_late_in_a_prompt_priced_with_their_read_let_larger_ones_in():
    """Steps whose true cost includes the context's read, 2 tokens over 4,000 at 2 ms a unit: priced with the
    read, the budget finds the price it was fed and gives 8 tokens; priced without (as before), each unit seems
    to cost 3.6 ms, and the same 100 ms of prefill a step would get 5."""
    true_ms = DECODE_MS + 2.0 * SHAPE.work(4000, 2)  # 136.006 ms
    for shape, price, tokens in ((SHAPE, 2.0, 8), (PrefillShape(1000.0, math.inf), 3.6, 5)):
        budget = PrefillBudget(2.0, shape)
        budget.observe(8, [], DECODE_MS)
        budget.observe(8, [(4000, 2)], true_ms)
        assert budget.ms_per_work == pytest.approx(price, abs=0.001)
        assert budget.allowance().take(4000, 500) == tokens  # read: 8 + 5 n = 48.036 <= 50; 9 would be 53.045


def test_the_step_ratio_sets_the_work():
    assert measured_budget(ms_per_work=2.0, ratio=1.5).allowance().take(0, 500) == 24  # 24.3 <= 25 < 25.325


def test_prefills_of_one_step_share_its_work():
    allowance = measured_budget(ms_per_work=2.0).allowance()
    assert allowance.take(2000, 10) == 10  # 34.055 of 50 (4 of it the read)
    assert allowance.take(0, 500) == 15  # 15.12 of the 15.945 left; no floor for the second
    assert allowance.take(0, 500) == 0


def test_the_price_follows_the_machine_and_ignores_a_spike():
    budget = measured_budget(ms_per_work=2.0, num_prefill_steps=3)
    budget.observe(8, [(0, 8)], 5_000.0)  # one step of a noisy neighbour
    assert budget.allowance().take(0, 500) == 48  # the median price did not move
    for _ in range(NUM_PREFILL_STEPS):  # the machine got twice as slow at prefill
        budget.observe(8, [(0, 8)], DECODE_MS + 4.0 * SHAPE.work(0, 8))
    assert budget.ms_per_work == pytest.approx(4.0)
    assert budget.allowance().take(0, 500) == 24  # 24.3 <= 25 < 25.325


def test_steps_without_decodes_are_not_measured():
    budget = measured_budget(ms_per_work=2.0)
    budget.observe(0, [(0, 2048)], 9_000.0)  # a prefill alone: no stream waited on it
    budget.observe(0, [], 1.0)
    assert (budget.decode_ms, budget.allowance().take(0, 500)) == (DECODE_MS, 48)


def test_a_long_run_of_prefill_steps_is_broken_by_one_decode_only_step():
    budget = measured_budget(ms_per_work=2.0)  # 3 decode-only steps, then 1 with prefill work
    for _ in range(REFRESH_STEPS - 2):
        budget.observe(8, [(0, 8)], DECODE_MS + 2.0 * SHAPE.work(0, 8))
    assert budget.allowance().take(0, 500) == 48  # 31 steps with prefill in a row: not yet
    budget.observe(8, [(0, 8)], DECODE_MS + 2.0 * SHAPE.work(0, 8))
    refresh = budget.allowance()  # the 32nd: this step runs the decodes alone, not even the floor
    assert (refresh.take(0, 500), refresh.take(0, 500)) == (0, 0)
    budget.observe(8, [], 3 * DECODE_MS)  # the decodes alone, measured now: their contexts grew
    # decode_ms is the median of the 4 recent decode-only steps: 100 ms; with 300 ms steps it moves
    assert budget.decode_ms == DECODE_MS
    for _ in range(4):
        budget.observe(8, [], 3 * DECODE_MS)
    assert budget.decode_ms == 3 * DECODE_MS
    assert budget.allowance().take(0, 500) == 500  # 300 ms of prefill work at ~0 ms a unit (its median now)


def test_a_refresh_filled_by_short_prompts_is_not_asked_again_at_once():
    budget = measured_budget(ms_per_work=2.0)
    for _ in range(REFRESH_STEPS - 1):
        budget.observe(8, [(0, 8)], DECODE_MS + 2.0 * SHAPE.work(0, 8))
    assert budget.allowance().take(0, 500) == 0  # asked for a decode-only step ...
    budget.observe(8, [(0, 30)], DECODE_MS + 2.0 * SHAPE.work(0, 30))  # ... a short prompt (not priced) came
    assert budget.allowance().take(0, 500) == 48  # the long prompt is not held back again for REFRESH_STEPS steps
    for _ in range(REFRESH_STEPS - 2):
        budget.observe(8, [(0, 8)], DECODE_MS + 2.0 * SHAPE.work(0, 8))
    assert budget.allowance().take(0, 500) == 48
    budget.observe(8, [(0, 8)], DECODE_MS + 2.0 * SHAPE.work(0, 8))
    assert budget.allowance().take(0, 500) == 0


def test_decode_only_steps_out_of_the_window_price_nothing_while_recent_ones_exist():
    budget = PrefillBudget(2.0, SHAPE)
    budget.observe(8, [], DECODE_MS)
    for _ in range(DECODE_WINDOW_STEPS):  # the refresh asks for none: nobody calls allowance() here
        budget.observe(8, [(0, 8)], DECODE_MS + 2.0 * SHAPE.work(0, 8))
    assert budget.decode_ms == DECODE_MS  # out of the window, but the only one: kept
    budget.observe(8, [], 2 * DECODE_MS)
    assert budget.decode_ms == 2 * DECODE_MS  # the old one no longer counts


def test_three_refreshes_into_a_prompt_outvote_the_decode_steps_before_it():
    """A slow spell before the prompt (32 decode-only steps at 150 ms) prices it only until three refreshes have
    measured the decodes as they are now (100 ms)."""
    budget = PrefillBudget(2.0, SHAPE)
    for _ in range(32):
        budget.observe(8, [], 1.5 * DECODE_MS)
    seen = []
    while len(seen) < 3:
        if budget.allowance().floor == 0:  # a refresh: the decodes alone
            budget.observe(8, [], DECODE_MS)
            seen.append(budget.decode_ms)
        else:
            budget.observe(8, [(0, 8)], DECODE_MS + 2.0 * SHAPE.work(0, 8))
    assert seen == [1.5 * DECODE_MS, 1.5 * DECODE_MS, DECODE_MS]  # 3 * REFRESH_STEPS steps in: the refreshes alone


def test_free_prefill_is_bounded_by_the_token_caps_alone():
    budget = measured_budget(ms_per_work=0.0)
    assert budget.allowance().take(0, 500) == 500


def test_a_ratio_below_one_is_refused():
    with pytest.raises(ValueError, match="step_ratio"):
        PrefillBudget(0.5, SHAPE)
    for bad in (0.5, -1.0, True):
        with pytest.raises(ConfigError, match="long_prefill_step_ratio"):
            EngineConfig("smollm2-135m", long_prefill_step_ratio=bad)
    assert EngineConfig("smollm2-135m", long_prefill_step_ratio=0).long_prefill_step_ratio == 0


def test_the_budget_is_on_where_clients_stream_and_off_for_offline_batches():
    assert EngineConfig("smollm2-135m").long_prefill_step_ratio == 0  # LLM.generate: nobody waits between tokens
    worker = load_settings(WorkerSettings, env={})  # a serving worker's engine: its clients stream
    assert worker.engine_config("smollm2-135m").long_prefill_step_ratio == 1.5


def plan(output):
    return [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]


def step(scheduler, seconds):
    output = scheduler.schedule()
    scheduler.observe_step(output, seconds)
    scheduler.update(output, {s.request.request_id: 7 for s in output.scheduled if s.needs_sample})
    return plan(output)


def priced_scheduler(max_num_batched_tokens: int) -> Scheduler:
    """A scheduler pricing prefill at 2x, with one request "a" (3 prompt tokens, 100 to generate) waiting."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=64),
        KVCacheManager(128, 16),
        PrefillBudget(2.0, SHAPE),
    )
    scheduler.add_request(make_request("a", list(range(3)), SamplingParams(max_tokens=100, ignore_eos=True)))
    return scheduler


def test_the_scheduler_prices_a_long_prompt_beside_decodes():
    """Before the budget: 64 tokens a step (the token cap) whatever a step cost."""
    scheduler = priced_scheduler(256)
    assert step(scheduler, 0.5) == [("a", 3)]  # a prefill alone: the whole budget, and not measured
    assert step(scheduler, 0.1) == [("a", 1)]  # decode-only: 100 ms
    scheduler.add_request(make_request("long", list(range(100, 400)), SamplingParams(max_tokens=1)))
    assert step(scheduler, (DECODE_MS + 2.0 * SHAPE.work(0, 2)) / 1e3) == [("a", 1), ("long", 2)]  # floor
    # priced at 2 ms per token-equivalent: 50 of them; after 2 tokens 48 fit (49.276), 49 would not (50.327)
    assert step(scheduler, (DECODE_MS + 2.0 * SHAPE.work(2, 48)) / 1e3) == [("a", 1), ("long", 48)]
    assert step(scheduler, 0.2) == [("a", 1), ("long", 46)]  # 50 in: 46 (49.481); 47 (50.578) would not


def test_a_short_prompt_beside_streams_is_not_priced():
    """Only prompts over the token cap (64 here) are priced: a short one arriving beside a stream comes in whole,
    where the long prompt of the test above got the unmeasured floor of 2."""
    scheduler = priced_scheduler(256)
    assert step(scheduler, 0.5) == [("a", 3)]
    assert step(scheduler, 0.1) == [("a", 1)]  # decode-only: 100 ms
    scheduler.add_request(make_request("short", list(range(100, 164)), SamplingParams(max_tokens=1)))
    assert step(scheduler, 0.3) == [("a", 1), ("short", 64)]


def test_a_prompt_with_only_its_last_token_left_is_no_stream_to_protect():
    scheduler = priced_scheduler(2)
    assert step(scheduler, 0.1) == [("a", 2)]  # one token of its prompt left: it waits for its first
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=256)
    scheduler.add_request(make_request("long", list(range(100, 400)), SamplingParams(max_tokens=1)))
    assert step(scheduler, 0.1) == [("a", 1), ("long", 64)]  # the token cap, not the unmeasured floor of 2
    assert step(scheduler, 0.1) == [("a", 1), ("long", 2)]  # "a" streams now: the floor
