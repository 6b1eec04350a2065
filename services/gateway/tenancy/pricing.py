"""What tokens cost: the price of one (plan, model) row of the prices table, and the one cost function that the
usage ledger (exact dollars, stored with each record) and the spend budgets (whole micro-dollars, rounded up)
share, so a budget counts exactly what the bill will say."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

MILLION = Decimal(1_000_000)
COST_QUANTUM = Decimal("1e-12")  # usage_records.cost is NUMERIC(24, 12): dollars to the picodollar


@dataclass(frozen=True)
class TokenPrice:
    """US dollars per million tokens, as the prices table holds them (the same number is micro-dollars a token)."""

    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal

    @classmethod
    def of_row(cls, row: Any) -> TokenPrice:
        """From a prices-table row (or anything with its three columns)."""
        return cls(Decimal(row.input_per_mtok), Decimal(row.cached_input_per_mtok), Decimal(row.output_per_mtok))

    def cost(self, num_prompt: int, num_cached: int, num_completion: int) -> Decimal:
        """Dollars: uncached prompt tokens at the input price, cached ones at the cached price, completion tokens
        at the output price."""
        uncached = max(num_prompt - num_cached, 0)
        total = (
            uncached * self.input_per_mtok
            + num_cached * self.cached_input_per_mtok
            + num_completion * self.output_per_mtok
        )
        return (total / MILLION).quantize(COST_QUANTUM)

    def micros(self, num_prompt: int, num_cached: int, num_completion: int) -> int:
        """The same cost in whole micro-dollars, rounded up: what a spend budget counts."""
        return math.ceil(self.cost(num_prompt, num_cached, num_completion) * MILLION)

    def most_micros(self, num_prompt: int, num_completion: int) -> int:
        """The most a request can cost: every prompt token uncached."""
        return self.micros(num_prompt, 0, num_completion)
