"""Expert placement for expert parallelism: which logical expert each physical slot of each MoE layer holds.

The problem and its vocabulary are DeepSeek EPLB's. `weight` (L, E): tokens routed to each logical expert of
each MoE layer (a smoothed window). `num_replicas` physical slots per layer (E plus redundant ones) over
`num_gpus` GPUs, slots_per_gpu each: slot s lives on GPU s // slots_per_gpu. GPUs sit on `num_nodes` nodes
(gpus_per_node each, in order); experts form `num_groups` equal groups (group-limited routing sends a token to
few groups). An expert with c replicas sends each replica 1/c of its tokens, so a GPU's load is the sum over its
slots of weight / count, and a layer's balancedness is mean / max GPU load (1.0: perfectly even).

Policies, EPLB's two:
- hierarchical (`auto` picks it when num_groups % num_nodes == 0): pack groups onto nodes (equal counts, even
  load), replicate the hottest experts within each node, pack each node's replicas onto its GPUs. A group's
  tokens never leave its node.
- global: replicate over all experts, pack over all GPUs.
Replication adds a replica to the expert with the most tokens per replica; packing puts the heaviest replica on
the lightest GPU with room. Beyond EPLB (the gaps its users report):
- a GPU never holds two replicas of one expert when another GPU with room does not (a second copy on one GPU
  balances nothing and costs memory);
- local search after the greedy packing: swap a slot of the heaviest GPU with one elsewhere, or turn a spare
  replica of a cold expert into a replica of a hot one, while that lowers the heaviest GPU;
- the cost of moving weights: with `max_moves`, a plan starts from the current placement and changes at most
  that many slots per layer; the full plan is taken only when it beats that by more than `replan_gain`, and it
  is then aligned to the current placement (GPUs matched by the experts they keep), so few weights move.
Stopping the world is the engine's side: it builds the new weights off its thread and swaps them between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mesh.eplb_search import align, improve, lightest_partition

POLICIES = ("auto", "hierarchical", "global")
_EPS = 1e-9


@dataclass(frozen=True)
class Topology:
    num_replicas: int  # physical slots per layer
    num_groups: int
    num_nodes: int
    num_gpus: int

    def __post_init__(self) -> None:
        for name in ("num_replicas", "num_groups", "num_nodes", "num_gpus"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_replicas % self.num_gpus:
            raise ValueError(f"num_replicas {self.num_replicas} is not a multiple of num_gpus {self.num_gpus}")
        if self.num_gpus % self.num_nodes:
            raise ValueError(f"num_gpus {self.num_gpus} is not a multiple of num_nodes {self.num_nodes}")

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    def resolve(self, policy: str) -> str:
        """The policy `auto` stands for; ValueError when hierarchical cannot apply."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        divides = self.num_groups % self.num_nodes == 0
        if policy == "hierarchical" and not divides:
            raise ValueError(
                f"the hierarchical policy needs num_groups ({self.num_groups}) to be a multiple of "
                f"num_nodes ({self.num_nodes})"
            )
        if policy == "auto":
            return "hierarchical" if divides and self.num_nodes > 1 else "global"
        return policy


@dataclass(frozen=True)
class PlanOptions:
    policy: str = "auto"  # auto | hierarchical | global
    max_moves: int | None = None  # with a current placement: change at most this many slots per layer (None: no limit)
    min_gain: float = 0.0  # keep a layer as it is when moves would gain less balancedness than this
    replan_gain: float = 0.05  # take the full plan (aligned) when it beats the limited one by more than this

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_moves is not None and self.max_moves < 0:
            raise ValueError(f"max_moves must not be negative, got {self.max_moves}")


@dataclass(frozen=True)
class Plan:
    policy: str  # the policy that ran (auto resolved)
    phy2log: np.ndarray  # (L, S) int64: the logical expert of each slot
    gpu_loads: np.ndarray  # (L, G) float64: tokens each GPU computes
    balancedness: np.ndarray  # (L,) mean / max GPU load
    num_moved: np.ndarray  # (L,) slots whose expert changed from the current placement (0 without one)

    @property
    def logcnt(self) -> np.ndarray:
        """(L, E) replicas per logical expert."""
        num_experts = int(self.phy2log.max()) + 1
        return np.stack([np.bincount(row, minlength=num_experts) for row in self.phy2log])

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "phy2log": self.phy2log.tolist(),
            "gpu_loads": [[round(float(v), 6) for v in row] for row in self.gpu_loads],
            "max_gpu_load": [round(float(v), 6) for v in self.gpu_loads.max(axis=1)],
            "balancedness": [round(float(v), 6) for v in self.balancedness],
            "num_moved": int(self.num_moved.sum()),
            "num_moved_per_layer": self.num_moved.tolist(),
        }


# -- evaluation --------------------------------------------------------------------------------------------------


def gpu_loads(weight: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """(L, E), (L, S) -> (L, G): each slot carries weight / count of its expert."""
    weight = np.asarray(weight, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    counts = np.stack([np.bincount(row, minlength=weight.shape[1]) for row in phy2log])  # (L, E)
    per_slot = np.take_along_axis(weight / np.maximum(counts, 1), phy2log, axis=1)  # (L, S)
    return per_slot.reshape(phy2log.shape[0], num_gpus, -1).sum(axis=2)


def balancedness(loads: np.ndarray) -> np.ndarray:
    """(L, G) -> (L,) mean / max; 1.0 for a layer without load."""
    peak = loads.max(axis=-1)
    return np.where(peak > 0, loads.mean(axis=-1) / np.where(peak > 0, peak, 1.0), 1.0)


def default_placement(num_experts: int, num_replicas: int) -> np.ndarray:
    """What an engine runs before any plan: slot s holds expert s % num_experts."""
    return np.arange(num_replicas, dtype=np.int64) % num_experts


# -- greedy steps --------------------------------------------------------------------------------------------------


def replicate(weight: np.ndarray, num_slots: int, max_count: int) -> np.ndarray:
    """(E,) -> replicas per expert (E,), summing to num_slots: each spare slot goes to the expert with the most
    tokens per replica (ties: the lower id), never past max_count replicas."""
    counts = np.ones(len(weight), dtype=np.int64)
    for _ in range(num_slots - len(weight)):
        per_replica = np.where(counts < max_count, weight / counts, -1.0)
        counts[int(np.argmax(per_replica))] += 1
    return counts


def pack(
    item_weight: np.ndarray, item_key: np.ndarray, num_bins: int, per_bin: int, num_keys: int, spread_keys: bool = True
) -> np.ndarray:
    """Bin of each item, per_bin items per bin: heaviest item first (ties: lower index) into the lightest bin
    with room (ties: the lower bin); with spread_keys, one that holds no item of the same key if there is one."""
    bins = np.empty(len(item_weight), dtype=np.int64)
    loads = np.zeros(num_bins)
    sizes = np.zeros(num_bins, dtype=np.int64)
    holds = np.zeros((num_bins, num_keys), dtype=bool)
    for item in np.argsort(-item_weight, kind="stable"):
        room = sizes < per_bin
        fresh = room & ~holds[:, item_key[item]] if spread_keys else room
        choice = int(np.argmin(np.where(fresh if fresh.any() else room, loads, np.inf)))
        bins[item] = choice
        loads[choice] += item_weight[item]
        sizes[choice] += 1
        holds[choice, item_key[item]] = True
    return bins


def replicate_and_pack(weight: np.ndarray, num_slots: int, num_gpus: int) -> np.ndarray:
    """A fresh placement of one domain (a node, or everything): (E,) -> phy2log (num_slots,).

    Two starts, each finished by local search, the better kept (ties: the first): packing that spreads an
    expert's replicas over GPUs, and packing that ignores them, its second copies on a GPU then turned into
    replicas of other experts (a GPU's two copies of one expert act as one copy and a wasted slot)."""
    counts = replicate(weight, num_slots, max(num_gpus, -(-num_slots // len(weight))))
    experts = np.repeat(np.arange(len(weight)), counts)  # one item per replica
    best, best_score = None, -1.0
    for spread in (True, False):
        bins = pack(weight[experts] / counts[experts], experts, num_gpus, num_slots // num_gpus, len(weight), spread)
        placement = improve(weight, experts[np.lexsort((experts, bins))], num_gpus, max_moves=None)
        score = float(balancedness(gpu_loads(weight[None], placement[None], num_gpus))[0])
        if score > best_score + _EPS:
            best, best_score = placement, score
    assert best is not None
    return best


# -- policies ------------------------------------------------------------------------------------------------------


def plan_global(weight: np.ndarray, topology: Topology) -> np.ndarray:
    """(E,) -> phy2log (S,)."""
    return replicate_and_pack(weight, topology.num_replicas, topology.num_gpus)


def plan_hierarchical(weight: np.ndarray, topology: Topology) -> np.ndarray:
    """(E,) -> phy2log (S,): groups to nodes, then each node on its own."""
    group_size = len(weight) // topology.num_groups
    groups_per_node = topology.num_groups // topology.num_nodes
    group_weight = weight.reshape(topology.num_groups, group_size).sum(axis=1)
    node_of_group = pack(
        group_weight, np.arange(topology.num_groups), topology.num_nodes, groups_per_node, topology.num_groups
    )
    order = np.lexsort((np.arange(topology.num_groups), node_of_group))  # groups by node, then id
    node_groups = order.reshape(topology.num_nodes, groups_per_node)
    node_groups = _improve_groups(group_weight, node_groups)
    slots_per_node = topology.num_replicas // topology.num_nodes
    placement = []
    for groups in node_groups:
        experts = (np.sort(groups)[:, None] * group_size + np.arange(group_size)).ravel()  # node-local -> global
        local = replicate_and_pack(weight[experts], slots_per_node, topology.gpus_per_node)
        placement.append(experts[local])
    return np.concatenate(placement)


def _improve_groups(group_weight: np.ndarray, node_groups: np.ndarray) -> np.ndarray:
    """Swap groups between nodes while that lowers the heaviest node, then search exhaustively (within a step
    budget) for an assignment with a lighter heaviest node: the node loads bound every GPU's."""
    num_nodes = node_groups.shape[0]
    improved = improve(group_weight, node_groups.ravel(), num_nodes, max_moves=None, replicas=False)
    improved = improved.reshape(num_nodes, -1)
    better = lightest_partition(group_weight, num_nodes, float(group_weight[improved].sum(axis=1).max()))
    return improved if better is None else better


def node_groups_of(phy2log: np.ndarray, topology: Topology, num_experts: int) -> list[np.ndarray] | None:
    """The groups each node holds in a hierarchical placement, or None when phy2log is not one (a group split
    over nodes, or a node without its share of groups)."""
    group_size = num_experts // topology.num_groups
    per_node = phy2log.reshape(topology.num_nodes, -1) // group_size
    groups = [np.unique(row) for row in per_node]
    if any(len(g) != topology.num_groups // topology.num_nodes for g in groups):
        return None
    if len(np.unique(np.concatenate(groups))) != topology.num_groups:
        return None
    return groups


# -- entry point ---------------------------------------------------------------------------------------------------


def rebalance(
    weight: np.ndarray | list[list[float]],
    topology: Topology,
    current: np.ndarray | None = None,
    options: PlanOptions = PlanOptions(),
) -> Plan:
    """A placement for every layer of `weight` (L, E). With `current` (L, S): num_moved counts against it, the
    plan is aligned to it, and options.max_moves limits the change (see the module's docstring)."""
    weight = _check_weight(weight, topology)
    policy = topology.resolve(options.policy)
    if current is not None:
        current = _check_current(current, weight.shape, topology)
    rows = [
        _plan_layer(weight[i], topology, policy, None if current is None else current[i], options)
        for i in range(len(weight))
    ]
    phy2log = np.stack(rows) if rows else np.zeros((0, topology.num_replicas), dtype=np.int64)
    loads = gpu_loads(weight, phy2log, topology.num_gpus)
    moved = (phy2log != current).sum(axis=1) if current is not None else np.zeros(len(weight), dtype=np.int64)
    return Plan(policy, phy2log, loads, balancedness(loads), moved)


def _plan_layer(
    weight: np.ndarray, topology: Topology, policy: str, current: np.ndarray | None, options: PlanOptions
) -> np.ndarray:
    hierarchical = policy == "hierarchical"

    def full_plan() -> np.ndarray:
        fresh = plan_hierarchical(weight, topology) if hierarchical else plan_global(weight, topology)
        if current is None:
            return fresh
        return align(fresh, current, topology.num_gpus, topology.num_nodes if hierarchical else 1, len(weight))

    if current is None or options.max_moves is None:
        return full_plan()
    limited = _improve_in_place(weight, current, topology, hierarchical, options.max_moves)
    if limited is None:
        return full_plan()
    score = _score(weight, topology.num_gpus)
    if options.replan_gain < 1.0:  # balancedness gains stay under 1: a full plan could win
        fresh = full_plan()
        if score(fresh) - score(limited) > options.replan_gain:
            return fresh
    if score(limited) - score(current) < options.min_gain:
        return current
    return limited


def _improve_in_place(
    weight: np.ndarray, current: np.ndarray, topology: Topology, hierarchical: bool, max_moves: int
) -> np.ndarray | None:
    """`current` improved with at most max_moves changed slots (hierarchical: within nodes, over the nodes in
    turn, sharing the budget); None when current is not a placement of the policy's shape."""
    if not hierarchical:
        return improve(weight, current, topology.num_gpus, max_moves)
    if node_groups_of(current, topology, len(weight)) is None:
        return None
    group_size = len(weight) // topology.num_groups
    result = current.copy()
    budget = max_moves
    for node, slots in enumerate(current.reshape(topology.num_nodes, -1)):
        experts = np.unique(slots // group_size)[:, None] * group_size + np.arange(group_size)
        experts = experts.ravel()
        local = np.searchsorted(experts, slots)
        improved = improve(weight[experts], local, topology.gpus_per_node, budget)
        budget -= int((improved != local).sum())
        result[node * len(slots) : (node + 1) * len(slots)] = experts[improved]
    return result


def _score(weight: np.ndarray, num_gpus: int) -> Callable[[np.ndarray], float]:
    def score(phy2log: np.ndarray) -> float:
        return float(balancedness(gpu_loads(weight[None], phy2log[None], num_gpus))[0])

    return score


def _check_weight(weight: np.ndarray | list[list[float]], topology: Topology) -> np.ndarray:
    array = np.asarray(weight, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] == 0:
        raise ValueError(f"weight must be a (layers, experts) matrix, got shape {array.shape}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError("weight must hold finite, non-negative token counts")
    num_experts = array.shape[1]
    if num_experts % topology.num_groups:
        raise ValueError(f"{num_experts} experts do not split into num_groups {topology.num_groups} equal groups")
    if topology.num_replicas < num_experts:
        raise ValueError(f"num_replicas {topology.num_replicas} is fewer than the {num_experts} experts")
    return array


def _check_current(current: np.ndarray, shape: tuple[int, ...], topology: Topology) -> np.ndarray:
    array = np.asarray(current, dtype=np.int64)
    num_layers, num_experts = shape
    if array.shape != (num_layers, topology.num_replicas):
        raise ValueError(f"the current placement must be ({num_layers}, {topology.num_replicas}), got {array.shape}")
    if (array < 0).any() or (array >= num_experts).any():
        raise ValueError(f"the current placement must hold expert ids in [0, {num_experts})")
    for layer, row in enumerate(array):
        if len(np.unique(row)) != num_experts:
            raise ValueError(f"the current placement of layer {layer} leaves some expert without a slot")
    return array
