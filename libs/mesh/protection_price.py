"""Protection priced by what a loss would cost: each block's erasure-coding level follows its expected recompute
cost, within a storage budget, instead of one `KVMESH_KV_PROTECTION` level for all.

A block's price is the prefill seconds its loss would cost, times the chance it is asked for again:
`reuse x prefill_s(tokens before it, its tokens and those of the cached chain below it)` (`recompute_price`). A
block deep in a long context costs more to recompute (attention grows with depth), and losing a chain's head makes
every block after it useless, so a head is priced with its chain.

`assign` spends the budget (bytes stored per block byte, averaged over blocks) where it saves the most: every
block starts at the cheapest level; then, for each number of node losses in turn (1, 2, ...), the highest-priced
blocks climb to the cheapest level that survives that many, while the budget lasts. Survival of one node loss for
many blocks is worth more per byte than surviving two for a few, hence the order. The store's repair follows the
same price: blocks with more parity (the writer priced them higher) are repaired first (`repair_rank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mesh.erasure import Protection
from mesh.routing.cost import CostModel

# what the writer's settings will be called (prefill writes blocks; wiring it there is still to do)
SETTING_NAMES = ("KVMESH_KV_PROTECTION_LEVELS", "KVMESH_KV_PROTECTION_BUDGET")


def overhead(protection: Protection) -> float:
    """Bytes stored per byte of block: (k + m) / k."""
    return protection.num_total / protection.num_data


def parse_levels(text: str) -> tuple[Protection, ...]:
    """ "1+0,4+1,1+2" -> the levels, cheapest (fewest bytes) first. Raises ValueError."""
    levels = [Protection.parse(part) for part in text.split(",") if part.strip()]
    if not levels:
        raise ValueError("expected k+m levels, comma separated, e.g. 1+0,4+1,1+2")
    return tuple(sorted(set(levels), key=lambda p: (overhead(p), -p.num_parity, p.num_data)))


@dataclass(frozen=True)
class PricedProtection:
    levels: tuple[Protection, ...]  # cheapest first
    budget: float  # bytes stored per block byte, over all blocks (1.0: no room for parity)

    @classmethod
    def parse(
        cls, levels: str, budget: float, num_nodes: int | None = None, names: tuple[str, str] = SETTING_NAMES
    ) -> PricedProtection:
        """Checked settings: a ValueError that names the setting at fault (`names`: the levels', the budget's)."""
        levels_name, budget_name = names
        try:
            parsed = parse_levels(levels)
        except ValueError as exc:
            raise ValueError(f"{levels_name}={levels!r}: {exc}") from None
        if num_nodes is not None and parsed[0].num_total > num_nodes:
            raise ValueError(
                f"{levels_name}={levels!r}: the cheapest level {parsed[0]} needs "
                f"{parsed[0].num_total} store nodes, there are {num_nodes}"
            )
        if not budget >= overhead(parsed[0]):
            raise ValueError(
                f"{budget_name}={budget!r}: cannot hold the {parsed[0].num_total} fragments of the "
                f"cheapest level {parsed[0]} ({overhead(parsed[0]):g} bytes per block byte); raise it to at "
                f"least {overhead(parsed[0]):g} or add a cheaper level"
            )
        return cls(parsed, budget)

    def uniform(self) -> Protection:
        """One level for all within the budget: the one surviving the most node losses, fewest bytes among them."""
        fitting = [p for p in self.levels if overhead(p) <= self.budget]
        return max(fitting, key=lambda p: (p.num_parity, -overhead(p)))


def recompute_price(
    num_tokens: int, num_tokens_before: int, reuse_likelihood: float, cost: CostModel | None = None
) -> float:
    """Expected prefill seconds lost with a block: `num_tokens` (the block's and the cached chain's below it)
    recomputed after `num_tokens_before` tokens of context, times the chance they are needed again."""
    cost = cost or CostModel()
    seconds = cost.prefill_s(num_tokens_before, num_tokens) - cost.prefill_overhead_s * cost.scale
    return reuse_likelihood * seconds


def assign(prices: Sequence[float], plan: PricedProtection) -> list[Protection]:
    """Each block's level (blocks of equal size), highest prices protected first, within `plan.budget`."""
    chosen = [plan.levels[0]] * len(prices)
    spare = (plan.budget - overhead(plan.levels[0])) * len(prices)
    by_price = sorted(range(len(prices)), key=lambda i: -prices[i])
    for losses in range(1, max(p.num_parity for p in plan.levels) + 1):
        level = min((p for p in plan.levels if p.num_parity >= losses), key=overhead)
        for i in by_price:
            extra = overhead(level) - overhead(chosen[i])
            if chosen[i].num_parity >= losses or extra <= 0:
                continue
            if extra > spare + 1e-9:
                continue
            chosen[i] = level
            spare -= extra
    return chosen


def repair_rank(protection: Protection) -> tuple[int, float]:
    """Sort key for repair, most valuable first: more parity (priced higher by its writer), then more bytes."""
    return (-protection.num_parity, -overhead(protection))
