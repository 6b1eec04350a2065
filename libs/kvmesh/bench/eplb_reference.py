"""BASELINE, not used by the mesh: DeepSeek EPLB's `rebalance_experts`, re-implemented from its published
description (deepseek-ai/EPLB README; its example is tests/data/eplb/eplb_readme_example.json) so the
expert benchmark can compare against it.

Its steps, as published:
- balanced packing: items sorted by weight, heaviest first, each into the lightest pack that still has room
  (every pack takes the same number of items);
- replication: each redundant slot goes to the expert with the highest load per replica;
- hierarchical policy (when num_groups % num_nodes == 0): pack groups onto nodes, replicate within each node
  (its experts in the order its groups were packed), pack each node's replicas onto its GPUs;
- global policy otherwise: the same with one group and one node.
What it does not do (the gaps users report, which mesh.eplb addresses): it never looks at the current placement
(every plan may move any expert), and packing may put two replicas of one expert on the same GPU.

Ties: the sort is stable here (EPLB's torch sort is not; on its README example both give the same loads).
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """(n,) -> (pack of each item, its rank in the pack: the order it arrived), n // num_packs items per pack."""
    per_pack = len(weight) // num_packs
    packs = np.empty(len(weight), dtype=np.int64)
    ranks = np.empty(len(weight), dtype=np.int64)
    loads = [0.0] * num_packs
    sizes = [0] * num_packs
    for item in np.argsort(-weight, kind="stable"):
        pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=loads.__getitem__)
        packs[item], ranks[item] = pack, sizes[pack]
        loads[pack] += float(weight[item])
        sizes[pack] += 1
    return packs, ranks


def replicate_experts(weight: np.ndarray, num_slots: int) -> np.ndarray:
    """(E,) -> replicas per expert, the redundant slots given one by one to the highest load per replica."""
    counts = np.ones(len(weight), dtype=np.int64)
    for _ in range(num_slots - len(weight)):
        counts[int(np.argmax(weight / counts))] += 1
    return counts


def rebalance_layer(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """One layer: (E,) -> phy2log (num_replicas,), slot s on GPU s // (num_replicas // num_gpus)."""
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # EPLB's global policy
    group_size = len(weight) // num_groups
    group_node, group_rank = balanced_packing(weight.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phy2log = []
    for node in range(num_nodes):
        groups = sorted((g for g in range(num_groups) if group_node[g] == node), key=lambda g: group_rank[g])
        experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size) for g in groups])
        counts = replicate_experts(weight[experts], slots_per_node)
        replicas = np.repeat(np.arange(len(experts)), counts)
        gpu, rank = balanced_packing(weight[experts][replicas] / counts[replicas], gpus_per_node)
        phy2log.append(experts[replicas[np.lexsort((rank, gpu))]])
    return np.concatenate(phy2log)


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """(L, E) -> phy2log (L, num_replicas): EPLB's policy choice and steps."""
    weight = np.asarray(weight, dtype=np.float64)
    return np.stack([rebalance_layer(row, num_replicas, num_groups, num_nodes, num_gpus) for row in weight])
