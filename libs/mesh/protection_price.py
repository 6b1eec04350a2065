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

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from mesh.erasure import Protection
from mesh.routing.cost import CostModel

# the writer's settings (prefill writes blocks: services/prefill/config.py)
SETTING_NAMES = ("KVMESH_KV_PROTECTION_LEVELS", "KVMESH_KV_PROTECTION_BUDGET")
MAX_USES = 8  # uses counted per key: reuse likelihood is learned by uses up to this


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


@dataclass
class _Seen:
    depth: int  # blocks before the key in the first prompt that held it
    chain_end: int  # the deepest block position of any prompt that held it
    num_uses: int  # prompts that held it, capped at MAX_USES


class ReuseBook:
    """What a writer learns of its blocks from the prompts it sees, to price them (`price`): each key's depth, the
    deepest prompt it was part of (the chain that loses its use with it) and how many prompts used it; and, over
    all keys, the share of keys used u times that were used once more (the reuse likelihood of a key used u times,
    as `kvmesh bench kv-protection` learns it). Bounded: the `max_keys` keys seen last. Written only by its owner
    (prefill's StoreClient, on the event loop)."""

    def __init__(self, cost: CostModel | None = None, max_keys: int = 1 << 16) -> None:
        self.cost = cost or CostModel()
        self.max_keys = max_keys
        self._keys: OrderedDict[bytes, _Seen] = OrderedDict()
        self._num_reached: Counter[int] = Counter()  # u -> keys that reached u uses (u capped at MAX_USES)

    def note_prompt(self, keys: Sequence[bytes]) -> None:
        """A prompt's block keys in chain order (the first at depth 0)."""
        for depth, key in enumerate(keys):
            seen = self._keys.get(key)
            if seen is None:
                seen = self._keys[key] = _Seen(depth, len(keys) - 1, 0)
            seen.chain_end = max(seen.chain_end, len(keys) - 1)
            seen.num_uses = min(seen.num_uses + 1, MAX_USES)
            self._num_reached[seen.num_uses] += 1
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def reuse_likelihood(self, num_uses: int) -> float:
        """The share of keys used `num_uses` times that were used again (0.5 before anything is known)."""
        reached = self._num_reached[num_uses]
        if num_uses >= MAX_USES:
            return (reached + 1) / (reached + 2)
        return (self._num_reached[num_uses + 1] + 1) / (reached + 2)

    def price(self, key: bytes, block_tokens: int) -> float:
        """`recompute_price` of the key's block: its tokens and its chain's below it, after its depth's, times the
        reuse likelihood of its uses. A key no prompt showed is priced as a lone block at depth 0, used once."""
        seen = self._keys.get(key) or _Seen(0, 0, 1)
        num_tokens = (seen.chain_end - seen.depth + 1) * block_tokens
        return recompute_price(num_tokens, seen.depth * block_tokens, self.reuse_likelihood(seen.num_uses), self.cost)
