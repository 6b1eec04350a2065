"""`kvmesh bench kv-protection`: the expected prefill seconds lost when one store node dies, for the same bytes
stored, with protection priced by recompute cost (`mesh.protection_price`) against one level for all.

The trace is replayed up to its middle into an unlimited store spread over `num_nodes` nodes by rendezvous
hashing (`mesh.placement`, as the live store places fragments). There each block is priced from what the store
could know then: its tokens and depth, the chain cached below it, and the chance of reuse learned from the trace so
far (the share of blocks used u times that were used again, by u). Then every node dies in turn: a block coded
with no parity and a fragment on that node is lost. The rest of the trace is replayed; each request whose prefix
hit stops early at a lost block pays the prefill seconds (`mesh.routing.cost.CostModel`, DeepSeek-V3 on one H800
unit) of the tokens it can no longer read, and puts the blocks back. The figure is the mean over the nodes.

Plans, each with its bytes stored per block byte: `priced` (highest price protected first, within the budget),
`uniform` (one level for all: the most protective one the budget holds), and `spread` (the budget spent on the
same levels as priced, over blocks picked at random: what pricing adds over spending the same bytes blindly).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.bench.kvcache import key_of, load_trace
from mesh.erasure import Protection
from mesh.placement import rank_nodes
from mesh.protection_price import PricedProtection, assign, overhead, recompute_price
from mesh.routing.cost import CostModel

BLOCK_TOKENS = 512  # the Mooncake traces' block size
MAX_USES = 8

Requests = Sequence[tuple[float, list[int]]]


def reuse_rates(requests: Requests) -> dict[int, float]:
    """uses so far (capped) -> the share of blocks with that many uses that were used once more."""
    uses = Counter(hash_id for _, ids in requests for hash_id in ids)
    reached = Counter(min(u, MAX_USES) for n in uses.values() for u in range(1, n + 1))
    return {u: reached[u + 1] / reached[u] if u < MAX_USES else reached[u] / (reached[u] + len(uses)) for u in reached}


def prices(requests: Requests, cost: CostModel) -> dict[int, float]:
    """Each block's price after `requests`: reuse x seconds to recompute it and the chain cached below it."""
    uses: Counter[int] = Counter()
    depth: dict[int, int] = {}
    chain_end: dict[int, int] = {}  # the deepest block seen below (or at) each block
    for _, ids in requests:
        for position, hash_id in enumerate(ids):
            uses[hash_id] += 1
            depth.setdefault(hash_id, position)
        for hash_id in ids:
            chain_end[hash_id] = max(chain_end.get(hash_id, 0), len(ids) - 1)
    rates = reuse_rates(requests)
    return {
        hash_id: recompute_price(
            (chain_end[hash_id] - depth[hash_id] + 1) * BLOCK_TOKENS,
            depth[hash_id] * BLOCK_TOKENS,
            rates.get(min(n, MAX_USES), 0.0),
            cost,
        )
        for hash_id, n in uses.items()
    }


def lost_seconds(after: Requests, held: set[int], lost: set[int], cost: CostModel) -> float:
    """Prefill seconds the requests in `after` pay for reading a shorter prefix because `lost` is gone."""
    held, lost = set(held), set(lost)
    total = 0.0
    for _, ids in after:
        full = next((n for n, hash_id in enumerate(ids) if hash_id not in held), len(ids))
        short = next((n for n, hash_id in enumerate(ids[:full]) if hash_id in lost), full)
        if short < full:
            total += cost.prefill_s(short * BLOCK_TOKENS, (full - short) * BLOCK_TOKENS) - cost.prefill_overhead_s
        held.update(ids)
        lost.difference_update(ids)
    return total


def expected_loss(
    after: Requests, levels: dict[int, Protection], nodes: list[str], cost: CostModel
) -> tuple[float, float]:
    """(mean seconds lost over which node dies, the same as a share of the seconds the cache saves after)."""
    lost_by_node: dict[str, set[int]] = {node: set() for node in nodes}
    for hash_id, level in levels.items():
        if level.num_parity == 0:
            for node in rank_nodes(key_of(hash_id), nodes)[: level.num_data]:
                lost_by_node[node].add(hash_id)
    held = set(levels)
    seconds = [lost_seconds(after, held, lost_by_node[node], cost) for node in nodes]
    return sum(seconds) / len(nodes), max(seconds)


def run_protection_bench(trace: str, num_nodes: int, levels: str, budget: float, seed: int = 0) -> dict[str, Any]:
    nodes = [f"kvcache-{i}" for i in range(num_nodes)]
    plan = PricedProtection.parse(levels, budget, num_nodes, names=("--levels", "--budget"))
    started = time.perf_counter()
    requests = load_trace(trace)
    middle = len(requests) // 2
    before, after = requests[:middle], requests[middle:]
    cost = CostModel()
    price = prices(before, cost)
    blocks = list(price)
    priced = assign([price[b] for b in blocks], plan)
    shuffled = blocks[:]
    random.Random(seed).shuffle(shuffled)
    spread = dict(zip(shuffled, priced, strict=True))  # the same multiset of levels, over random blocks
    plans = {
        "priced": dict(zip(blocks, priced, strict=True)),
        "spread": spread,
        "uniform": dict.fromkeys(blocks, plan.uniform()),
    }
    result: dict[str, Any] = {
        "trace": Path(trace).name,
        "num_nodes": num_nodes,
        "levels": [str(p) for p in plan.levels],
        "budget": budget,
        "num_blocks": len(blocks),
        "uniform_level": str(plan.uniform()),
    }
    for name, chosen in plans.items():
        mean_s, worst_s = expected_loss(after, chosen, nodes, cost)
        result[name] = {
            "bytes_per_block_byte": round(sum(overhead(p) for p in chosen.values()) / len(chosen), 4),
            "levels": dict(Counter(str(p) for p in chosen.values())),
            "expected_lost_s": round(mean_s, 2),
            "worst_node_lost_s": round(worst_s, 2),
        }
    result["priced_over_uniform"] = _ratio(result["priced"], result["uniform"])
    result["priced_over_spread"] = _ratio(result["priced"], result["spread"])
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def _ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> float | None:
    return round(ours["expected_lost_s"] / theirs["expected_lost_s"], 4) if theirs["expected_lost_s"] else None
