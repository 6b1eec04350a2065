"""Expert placement (mesh.eplb) on cases small enough to check by hand, EPLB's README example, and the BASELINE
re-implementation of EPLB the benchmark compares against."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvmesh.bench import eplb_reference
from mesh.eplb import PlanOptions, Topology, balancedness, gpu_loads, pack, rebalance, replicate

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "eplb" / "eplb_readme_example.json"  # tests/data/README.md
EPLB_MAX_LOADS = [156.0, 179.5]  # what EPLB's README placement puts on its heaviest GPU, per layer


@pytest.fixture(scope="module")
def example() -> dict:
    return json.loads(EXAMPLE.read_text())


def duplicates_on_a_gpu(phy2log: np.ndarray, num_gpus: int) -> list[tuple[int, int, int]]:
    """(layer, gpu, expert) for every GPU that holds an expert twice."""
    found = []
    for layer, row in enumerate(phy2log):
        for gpu, slots in enumerate(row.reshape(num_gpus, -1)):
            values, counts = np.unique(slots, return_counts=True)
            found += [(layer, gpu, int(v)) for v in values[counts > 1]]
    return found


def test_replication_gives_each_spare_slot_to_the_most_tokens_per_replica() -> None:
    weight = np.array([10.0, 4.0, 2.0, 1.0])
    assert replicate(weight, 6, max_count=3).tolist() == [3, 1, 1, 1]  # 10 -> 5 -> 3.33: expert 0 twice
    assert replicate(weight, 6, max_count=2).tolist() == [2, 2, 1, 1]  # capped: the second goes to expert 1 (4)


def test_packing_is_heaviest_first_into_the_lightest_gpu_without_that_expert() -> None:
    # expert 1 (4.0) on GPU 0, expert 0's three replicas on GPUs 1, 2 and then 0 (not 1: it holds expert 0)
    weights = np.array([4.0, 8 / 3, 8 / 3, 8 / 3, 2.0, 2.0])
    keys = np.array([1, 0, 0, 0, 2, 3])
    assert pack(weights, keys, num_bins=3, per_bin=2, num_keys=4).tolist() == [0, 1, 2, 0, 1, 2]
    # EPLB's way: the lightest GPU with room, GPU 1, gets expert 0 a second time
    assert pack(weights, keys, 3, 2, 4, spread_keys=False).tolist() == [0, 1, 2, 1, 2, 0]


def test_global_plan_of_a_small_layer() -> None:
    # 4 experts (8, 4, 2, 2 tokens), 6 slots on 3 GPUs. Greedy replication gives expert 0 three replicas (2.67
    # each) and GPU 0 ends at 4 + 2.67; local search turns one into a replica of expert 1: counts 2, 2, 1, 1,
    # GPUs (1, 0) (1, 2) (0, 3) = 2 + 4, 2 + 2, 4 + 2. 16 tokens over 3 GPUs in pairs cannot beat 6.
    plan = rebalance([[8, 4, 2, 2]], Topology(num_replicas=6, num_groups=1, num_nodes=1, num_gpus=3))
    assert plan.policy == "global"
    assert plan.phy2log.tolist() == [[0, 1, 1, 2, 0, 3]]
    assert plan.logcnt.tolist() == [[2, 2, 1, 1]]
    assert plan.gpu_loads.tolist() == [[6.0, 4.0, 6.0]]
    assert plan.balancedness.tolist() == pytest.approx([16 / 3 / 6])
    assert plan.num_moved.tolist() == [0]


def test_readme_example_is_no_worse_than_eplb(example: dict) -> None:
    inputs = example["inputs"]
    topology = Topology(inputs["num_replicas"], inputs["num_groups"], inputs["num_nodes"], inputs["num_gpus"])
    hierarchical = rebalance(inputs["weight"], topology)
    assert hierarchical.policy == "hierarchical"
    assert hierarchical.gpu_loads.max(axis=1).tolist() == EPLB_MAX_LOADS  # the best there is with these groups
    # groups to nodes as EPLB's: node 0 holds groups 1, 2 (experts 3-8) in layer 0 and groups 2, 3 in layer 1
    node_experts = [sorted(set(row[:8].tolist())) for row in hierarchical.phy2log]
    assert node_experts == [[3, 4, 5, 6, 7, 8], [6, 7, 8, 9, 10, 11]]
    globally = rebalance(inputs["weight"], topology, options=PlanOptions(policy="global"))
    assert globally.gpu_loads.max(axis=1).tolist() == [136.0, 172.0]
    for plan in (hierarchical, globally):
        assert duplicates_on_a_gpu(plan.phy2log, topology.num_gpus) == []
        assert plan.logcnt.sum(axis=1).tolist() == [16, 16]
        np.testing.assert_allclose(plan.balancedness, plan.gpu_loads.mean(axis=1) / plan.gpu_loads.max(axis=1))


def test_the_eplb_baseline_reproduces_the_readme(example: dict) -> None:
    inputs, expected = example["inputs"], example["expected_output_from_readme"]["phy2log"]
    weight = np.array(inputs["weight"])
    phy2log = eplb_reference.rebalance_experts(
        weight, inputs["num_replicas"], inputs["num_groups"], inputs["num_nodes"], inputs["num_gpus"]
    )
    assert phy2log[0].tolist() == expected[0]
    assert phy2log[1].tolist() == example["caveats"]["alt_output_layer1_issue8"]  # a tie EPLB breaks either way
    assert gpu_loads(weight, phy2log, 8).max(axis=1).tolist() == EPLB_MAX_LOADS
    assert duplicates_on_a_gpu(phy2log, 8) == [(1, 3, 8)]  # the gap users report: expert 8 twice on GPU 3


def test_incremental_plans_respect_the_move_limit() -> None:
    topology = Topology(num_replicas=4, num_groups=1, num_nodes=1, num_gpus=2)
    current = np.array([[0, 1, 2, 3]])  # GPU 0 holds the two hot experts: loads 10 and 2
    weight = [[5, 5, 1, 1]]
    two = rebalance(weight, topology, current, PlanOptions(max_moves=2, replan_gain=1.0))
    assert (two.phy2log.tolist(), two.gpu_loads.tolist(), two.num_moved.tolist()) == ([[2, 1, 0, 3]], [[6.0, 6.0]], [2])
    one = rebalance(weight, topology, current, PlanOptions(max_moves=1, replan_gain=1.0))  # a swap moves two
    assert (one.phy2log.tolist(), one.num_moved.tolist()) == ([[0, 1, 2, 3]], [0])
    unlimited = rebalance(weight, topology, current, PlanOptions(max_moves=1, replan_gain=0.05))  # 1.0 vs 0.6
    assert (unlimited.gpu_loads.tolist(), unlimited.num_moved.tolist()) == ([[6.0, 6.0]], [2])
    small_gain = rebalance(weight, topology, current, PlanOptions(max_moves=2, min_gain=0.5, replan_gain=1.0))
    assert small_gain.num_moved.tolist() == [0]  # balancedness 0.6 -> 1.0 gains 0.4, under min_gain 0.5: kept


def test_a_spare_replica_moves_to_a_hot_expert_for_one_move() -> None:
    topology = Topology(num_replicas=6, num_groups=1, num_nodes=1, num_gpus=3)
    # loads 2 + 8, 2 + 1, 1 + 2: expert 3 (cold) has a spare replica, expert 1 (hot) one copy. Either spare of
    # expert 3 turned into expert 1 leaves 6 on the heaviest GPU; the first (slot 3) wins the tie.
    current = np.array([[0, 1, 2, 3, 3, 0]])
    plan = rebalance([[4, 8, 2, 2]], topology, current, PlanOptions(max_moves=1, replan_gain=1.0))
    assert plan.phy2log.tolist() == [[0, 1, 2, 1, 3, 0]]
    assert (plan.gpu_loads.tolist(), plan.num_moved.tolist()) == ([[6.0, 6.0, 4.0]], [1])


def test_a_full_plan_lands_in_the_current_slots_when_only_their_order_differs() -> None:
    rng = np.random.default_rng(0)
    topology = Topology(num_replicas=40, num_groups=4, num_nodes=2, num_gpus=8)
    weight = rng.integers(1, 1000, size=(3, 32)).astype(float)
    plan = rebalance(weight, topology)
    shuffled = plan.phy2log.reshape(3, 2, 4, 5)[:, ::-1][:, :, rng.permutation(4)][..., ::-1].reshape(3, 40)
    again = rebalance(weight, topology, shuffled)
    assert again.num_moved.tolist() == [0, 0, 0]
    assert np.array_equal(again.phy2log, shuffled)


def test_skewed_loads_plan_better_than_eplb_with_either_policy() -> None:
    rng = np.random.default_rng(1)
    weight = 1e5 / np.stack([rng.permutation(64) + 1 for _ in range(2)]) ** 1.2  # Zipf
    topology = Topology(num_replicas=72, num_groups=8, num_nodes=2, num_gpus=8)
    for policy, groups, nodes in (("global", 1, 1), ("hierarchical", 8, 2)):
        ours = rebalance(weight, topology, options=PlanOptions(policy=policy))
        eplb = eplb_reference.rebalance_experts(weight, 72, groups, nodes, 8)
        assert (ours.balancedness >= balancedness(gpu_loads(weight, eplb, 8)) - 1e-12).all(), policy
        assert duplicates_on_a_gpu(ours.phy2log, 8) == []


def test_inputs_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="num_replicas 10 is not a multiple of num_gpus 4"):
        Topology(10, 1, 1, 4)
    with pytest.raises(ValueError, match="hierarchical policy needs num_groups"):
        rebalance([[1, 2, 3]], Topology(6, 3, 2, 2), options=PlanOptions(policy="hierarchical"))
    with pytest.raises(ValueError, match="fewer than the 4 experts"):
        rebalance([[1, 2, 3, 4]], Topology(2, 1, 1, 2))
    with pytest.raises(ValueError, match="leaves some expert without a slot"):
        rebalance([[1, 2, 3, 4]], Topology(4, 1, 1, 2), current=np.array([[0, 1, 2, 2]]))
    with pytest.raises(ValueError, match="non-negative"):
        rebalance([[1, -2]], Topology(2, 1, 1, 1))
