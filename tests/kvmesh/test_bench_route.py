"""`kvmesh bench route`: trace reading, load scaling, and the simulator through the real policies on tiny traces
built here (exact hit rates, exact balance), replicas with and without shared assignments, and the command line
on the first requests of the Mooncake conversation trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.route import FIELDS, BenchConfig, LoadScale, run_route_bench
from kvmesh.bench.route_sim import SimConfig, Simulation, simulate
from kvmesh.bench.route_trace import TraceRequest, block_key, ideal_hit_rate, load_trace, spread_bursts
from kvmesh.cli import main
from mesh.routing import POLICIES, CostModel

# the first 300 requests of the Mooncake conversation trace (tests/data/README.md)
CONVERSATION = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_trace_first300.jsonl"
# a token costs 1 ms; KV moves for free
COST = CostModel(
    prefill_tokens_per_s=1000.0,
    prefill_overhead_s=0.0,
    attention_knee_tokens=1e12,
    decode_step_base_s=0.01,
    decode_s_per_kv_token=0.0,
    kv_bytes_per_token=0,
)


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    with open(path, "w") as file:
        for timestamp_ms, num_input, num_output, hash_ids in rows:
            file.write(
                json.dumps(
                    {
                        "timestamp": timestamp_ms,
                        "input_length": num_input,
                        "output_length": num_output,
                        "hash_ids": hash_ids,
                    }
                )
                + "\n"
            )
    return path


def request(arrival_s: float, *hash_ids: int, num_output: int = 3) -> TraceRequest:
    return TraceRequest(arrival_s, 512 * len(hash_ids), num_output, tuple(block_key(i) for i in hash_ids))


def test_traces_read_spread_and_ideal_hit_rate(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        [(1000, 1024, 5, [1, 2]), (1000, 1500, 5, [1, 3, 4]), (1000, 1500, 5, [1, 3, 4]), (4000, 600, 1, [5, 6])],
    )
    requests = load_trace(trace)  # full blocks only: 1500 tokens are 2 blocks (block 4 is partial), 600 one
    # three requests share the first timestamp: spread over the 3 s to the next one; the last one has no next
    assert [r.arrival_s for r in requests] == [0.0, 1.0, 2.0, 3.0]
    assert [r.arrival_s for r in load_trace(trace, spread=False)] == [0.0, 0.0, 0.0, 3.0]
    assert [r.block_hashes for r in requests] == [
        (block_key(1), block_key(2)),
        (block_key(1), block_key(3)),
        (block_key(1), block_key(3)),
        (block_key(5),),
    ]
    assert (requests[1].num_prompt_tokens, requests[1].num_output_tokens) == (1500, 5)
    assert ideal_hit_rate(requests) == 3 / 7  # block 1 twice, block 3 once, of 7 (partial block 4 is never a hit)
    assert len(load_trace(trace, limit=2)) == 2
    csv = tmp_path / "azure.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,1000,10\n"
        "2023-11-16 18:15:47.6805900,1024,20\n2023-11-16 18:15:48.6805900,511,20\n"
    )
    azure = load_trace(csv)
    assert [(r.arrival_s, r.num_prompt_tokens, len(r.block_hashes)) for r in azure] == [
        (0.0, 1000, 1),
        (1.0, 1024, 2),
        (2.0, 511, 0),
    ]
    assert ideal_hit_rate(azure) == 0.0


def test_spread_bursts_keeps_the_order_within_a_bucket() -> None:
    requests = [request(0.0, 1), request(0.0, 2), request(6.0, 3), request(6.0, 4), request(6.0, 5)]
    assert [r.arrival_s for r in spread_bursts(requests)] == [0.0, 3.0, 6.0, 8.0, 10.0]


def test_load_rescales_arrivals_to_the_offered_work() -> None:
    requests = [request(0.0, 1, 2), request(10.0, 1, 2, 3), request(20.0, 4)]
    config = BenchConfig(trace="-", sim=SimConfig(num_prefill=2, cost=COST))
    # ideal: the second request computes 1 block (the first two are cached): 1.024 + 0.512 + 0.512 = 2.048 s of work
    scale = LoadScale.of(requests, config)
    assert scale.factor_at_1 == pytest.approx(2.048 / 2 / 20)
    assert [r.arrival_s for r in scale.at(0.5)] == pytest.approx([0.0, 2.048 / 2, 2.048])
    assert scale.rate(0.5) == pytest.approx(3 / 2.048)
    prompt_basis = BenchConfig(trace="-", load_basis="prompt", sim=SimConfig(num_prefill=2, cost=COST))
    prompt = LoadScale.of(requests, prompt_basis)
    assert prompt.factor_at_1 == pytest.approx(3.072 / 2 / 20)


def test_round_robin_spreads_exactly_and_cache_aware_policies_hit() -> None:
    requests = [request(n * 10.0, 100 + n) for n in range(8)]  # unique one-block prompts, far apart
    config = SimConfig(num_prefill=4, num_decode=2, cost=COST, cache_tokens=10 * 512)
    result = simulate(requests, "round_robin", config)
    assert result.prefill_busy_s == [pytest.approx(1.024)] * 4  # two 0.512 s prompts each
    assert result.num_hit_blocks == 0 and result.ttft_s == [pytest.approx(0.512)] * 8
    assert result.tpot_s == [pytest.approx(0.01)] * 8  # two decode steps of 0.01 s, one at a time
    repeats = [request(n * 10.0, 1, 2, 3 + n) for n in range(4)]  # a shared two-block prefix
    assert simulate(repeats, "kvmesh", config).num_hit_blocks == 6
    assert simulate(repeats, "round_robin", config).num_hit_blocks == 0


def test_replicas_that_share_assignments_do_not_herd() -> None:
    requests = [request(0.0, 1, 2, 3, 4), request(0.1, 5, 6, 7, 8)]  # requests go to replica 0, then replica 1
    config = SimConfig(num_prefill=2, num_decode=1, cost=COST, heartbeat_s=100.0, num_replicas=2, share_delay_s=0.01)
    shared = simulate(requests, "least_load", config)
    alone = simulate(requests, "least_load", SimConfig(**{**config.__dict__, "share": False}))
    assert shared.prefill_busy_s == [pytest.approx(2.048)] * 2
    assert alone.prefill_busy_s == [pytest.approx(4.096), 0.0]  # both picked the worker idle at the last report


def test_a_seed_draws_the_heartbeat_phases_and_nothing_else() -> None:
    requests = load_trace(CONVERSATION, limit=120)
    even = Simulation(requests, "kvmesh", SimConfig(num_prefill=2, num_decode=2))
    assert even.heartbeat_phases() == [0.25, 0.5, 0.75, 1.0]  # seed 0: evenly staggered in worker order
    drawn = Simulation(requests, "kvmesh", SimConfig(num_prefill=2, num_decode=2, seed=1))
    drawn_phases = [0.8656357558875988, 0.15256626306276733, 0.23622538102338597, 0.7449309742605783]
    assert drawn.heartbeat_phases() == drawn_phases  # 1 - random.Random(1).random(), four times: each in (0, 1]
    loaded = CostModel(prefill_tokens_per_s=20_000.0)  # both prefill workers queue: reports go stale between beats

    def run(policy: str, seed: int) -> tuple[float, float]:
        result = simulate(requests, policy, SimConfig(num_prefill=2, num_decode=2, cost=loaded, seed=seed))
        return round(sum(result.ttft_s), 3), round(result.decode_efficiency, 4)

    # least_load counts reported queues as they were at the report: where reports fall moves its picks
    assert (run("least_load", 0), run("least_load", 1), run("least_load", 1)) == (
        (2469.08, 0.8298),
        (2502.263, 0.8642),
        (2502.263, 0.8642),  # a seed repeats
    )
    assert run("kvmesh", 0) == run("kvmesh", 1) == (2436.941, 0.9263)  # its predictions bridge the reports here
    assert run("round_robin", 0) == run("round_robin", 1)  # it reads no report


def test_late_binding_chooses_decode_when_the_kv_is_ready() -> None:
    """The same routers bind the decode worker at prefill's end (Router.bind_decode): prefill's picks and every TTFT
    are unchanged (no prefill policy reads decode), the decode balance is not; replicas share the bindings too."""
    requests = load_trace(CONVERSATION, limit=120)
    loaded = CostModel(prefill_tokens_per_s=20_000.0)

    def run(binding: str, num_replicas: int = 1) -> tuple[float, float]:
        config = SimConfig(num_prefill=2, num_decode=2, cost=loaded, num_replicas=num_replicas, decode_binding=binding)
        result = simulate(requests, "kvmesh", config)
        return round(sum(result.ttft_s), 3), round(result.decode_efficiency, 4)

    assert run("early") == (2436.941, 0.9263)
    assert run("late") == (2436.941, 0.9448)
    assert (run("early", 2), run("late", 2)) == ((2456.103, 0.9227), (2456.103, 0.9449))
    with pytest.raises(ValueError, match="unknown decode binding 'lazy'"):
        simulate(requests, "kvmesh", SimConfig(decode_binding="lazy"))


def test_every_policy_side_by_side(tmp_path: Path) -> None:
    rows = [(n * 200, 2048, 20, [0, 1000 + n % 5, 2000 + n, 3000 + n]) for n in range(40)]
    config = BenchConfig(
        trace=str(write_trace(tmp_path / "t.jsonl", rows)),
        num_bisections=1,
        sim=SimConfig(num_prefill=2, num_decode=2, cache_tokens=8 * 512),
    )
    result = run_route_bench("all", config, plot_dir=str(tmp_path / "plots"))
    assert list(result) == list(POLICIES)
    for fields in result.values():
        assert tuple(fields) == FIELDS
        assert fields["ideal_hit_rate"] == 0.4625  # block 0 hits 39 times, the 5 blocks after it 35: of 160
        assert 0 <= fields["hit_rate"] <= fields["ideal_hit_rate"] and fields["goodput"] > 0
        # the floor: 35 prompts with 2 blocks cached ideally, 4 with 1, the first with none; p99 between the last two
        cost = config.sim.cost
        low, high = cost.prefill_s(512, 1536), cost.prefill_s(0, 2048)
        assert fields["ttft_p99_floor_s"] == round(low + 0.61 * (high - low), 4)
        assert fields["ttft_p99_s"] >= fields["ttft_p99_floor_s"]  # no policy beats compute alone
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(
        ["route_ttft_cdf.png"] + [f"route_load_{name}.png" for name in POLICIES]
    )


def test_command_line_on_the_conversation_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "route", "--trace", str(CONVERSATION), "--limit", "300", "--policy", "kvmesh", "--json"]) == 0
    fields = json.loads(capsys.readouterr().out)
    assert tuple(fields) == FIELDS
    assert fields["hit_rate"] > 0.5 * fields["ideal_hit_rate"] and fields["prefill_imbalance"] >= 1.0
    assert main(["bench", "route", "--trace", str(CONVERSATION), "--policy", "fastest"]) == 2
    assert "unknown routing policy 'fastest'" in capsys.readouterr().err


def test_the_cost_model_calibrates_from_an_engine_bench_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmesh.bench.route_cli import calibration

    report = {
        "results": {
            "1": {"ours": {"prefill_tok_s": 900.0, "decode_tok_s": 20.0}},
            "8": {"ours": {"prefill_tok_s": 1500.0, "decode_tok_s": 100.0}},
            "32": {"ours": {"prefill_tok_s": 1400.0, "decode_tok_s": 160.0}},
        }
    }
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(report))
    # the best batched prefill rate; a step at the largest batch makes 32 tokens: 32 / 160 tok/s
    assert calibration(str(path)) == {"prefill_tokens_per_s": 1500.0, "decode_step_base_s": 0.2}
    trace = write_trace(tmp_path / "t.jsonl", [(n * 1000, 1024, 4, [n * 2, n * 2 + 1]) for n in range(6)])
    assert main(["bench", "route", "--trace", str(trace), "--calibrate", str(path), "--json"]) == 0
    fields = json.loads(capsys.readouterr().out)
    assert fields["tpot_p50_s"] >= 0.2  # steps as slow as the calibrated engine's
    path.write_text(json.dumps({"results": {}}))
    assert main(["bench", "route", "--trace", str(trace), "--calibrate", str(path)]) == 2
    assert "not a `kvmesh bench engine --json` report" in capsys.readouterr().err
