"""Expert parallelism inside one MoE layer: where each logical expert's copies sit, which copy each token uses,
and what every expert and rank computed.

A physical slot holds a copy of one logical expert's weights; the slots are spread evenly over the ranks of the
expert-parallel group (rank = slot // slots_per_rank; DeepSeek EPLB calls ranks GPUs). Here every rank lives in
this process: the slots are one stacked weight tensor, and a rank's load is what its slots computed. Hot experts
get several slots (replicas); a token goes to one of them.

Shapes: T tokens, k experts per token, E logical experts, S slots, I the expert's intermediate size, Hd hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PhysicalExperts:
    """One layer's placement with its weights: built whole (off the engine thread), swapped in whole, never
    changed afterwards."""

    version: int  # of the plan it came from (0: the engine's default placement)
    num_ranks: int
    phy2log: torch.Tensor  # (S,) int64: the logical expert in each slot
    log2phy: torch.Tensor  # (E, max replicas) int64: each expert's slots, -1 past its count
    logcnt: torch.Tensor  # (E,) int64: replicas of each expert
    w_gate_up: torch.Tensor  # (S, 2I, Hd)
    w_down: torch.Tensor  # (S, Hd, I)

    @classmethod
    def build(
        cls, phy2log: Sequence[int], w_gate_up: torch.Tensor, w_down: torch.Tensor, num_ranks: int, version: int
    ) -> PhysicalExperts:
        """Copy the logical weights (E, ...) into slot order. The identity placement shares them instead."""
        num_experts, device = w_gate_up.shape[0], w_gate_up.device
        slots = torch.tensor(list(phy2log), dtype=torch.long)
        logcnt = torch.bincount(slots, minlength=num_experts)
        log2phy = torch.full((num_experts, int(logcnt.max())), -1, dtype=torch.long)
        seen = [0] * num_experts
        for slot, expert in enumerate(slots.tolist()):
            log2phy[expert, seen[expert]] = slot
            seen[expert] += 1
        if torch.equal(slots, torch.arange(num_experts)):
            gate_up, down = w_gate_up, w_down
        else:
            index = slots.to(device)
            gate_up, down = w_gate_up.index_select(0, index), w_down.index_select(0, index)
        return cls(version, num_ranks, slots.to(device), log2phy.to(device), logcnt.to(device), gate_up, down)

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[0])

    def dispatch(self, topk_ids: torch.Tensor, first_token: int) -> torch.Tensor:
        """Logical ids (T, k) -> slot ids (T, k). Token i of the batch uses replica (first_token + i) mod its
        expert's count, so successive tokens rotate over the replicas. Every replica holds the same weights:
        the choice changes which rank computes, never the result."""
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None] + first_token  # (T, 1)
        replica = token % self.logcnt[topk_ids]  # (T, k)
        return self.log2phy[topk_ids, replica]


class ExpertCounters:
    """Pairs (token, chosen expert) routed to each logical expert and each slot since the last `take`.

    Written by the layer's forward and read by `take`, both on the engine thread. Counting stays on the device
    (no host sync per step).
    """

    def __init__(self, num_experts: int, num_slots: int, device: torch.device) -> None:
        self.expert_counts = torch.zeros(num_experts, dtype=torch.long, device=device)  # (E,)
        self.slot_counts = torch.zeros(num_slots, dtype=torch.long, device=device)  # (S,)

    def record(self, topk_ids: torch.Tensor, slot_ids: torch.Tensor | None) -> None:
        """topk_ids (T, k) logical; slot_ids (T, k), or None when slots are the logical experts themselves."""
        flat = topk_ids.reshape(-1)
        ones = torch.ones_like(flat)
        self.expert_counts.index_add_(0, flat, ones)
        self.slot_counts.index_add_(0, flat if slot_ids is None else slot_ids.reshape(-1), ones)

    def take(self) -> tuple[list[int], list[int]]:
        """(tokens per expert, tokens per slot), and start counting from zero."""
        counts = (self.expert_counts.tolist(), self.slot_counts.tolist())
        self.expert_counts.zero_()
        self.slot_counts.zero_()
        return counts
