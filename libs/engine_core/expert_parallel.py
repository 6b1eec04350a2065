"""The engine's MoE layers under expert parallelism: their placements, their counters, and plan changes.

Every MoE layer counts the tokens routed to each logical expert and each slot (cheap: index_add on the device).
With expert_parallel_size > 1 or redundant experts, each layer runs on a placement (engine_core.models.experts):
the default one until a plan arrives (slot s holds expert s % E), then the plan's. Changing placement never
stops the engine: `prepare` copies the new weights off the engine thread (it reads only the logical weights,
never written after loading), then `apply`, on the engine thread between two steps, swaps every layer's
placement at once. A replica holds the same weights as its expert, so outputs do not change, only which rank
computes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from engine_core.config import ConfigError, EngineConfig, ModelConfig
from engine_core.models.deepseek_v3 import DeepseekMoE
from engine_core.models.deepseek_v4.blocks import V4MoE
from engine_core.models.experts import ExpertCounters, PhysicalExperts

MoELayer = DeepseekMoE | V4MoE  # DeepSeek-V4's hash-routed layers count and place like the scored ones


@dataclass(frozen=True)
class ExpertLayout:
    """What a rebalancer needs to plan for this engine. "Layers" are the MoE layers, in model order."""

    num_layers: int
    first_layer: int  # the model's index of the first MoE layer (the dense ones before it are not counted)
    num_experts: int  # logical experts per layer
    num_groups: int  # expert groups of the gate's group-limited routing
    num_slots: int  # physical slots per layer: num_experts + num_redundant_experts
    num_ranks: int  # expert_parallel_size: slot s lives on rank s // (num_slots // num_ranks)


@dataclass(frozen=True)
class ExpertLoadReport:
    version: int  # the placement that ran (its latest, if one was applied meanwhile)
    num_steps: int  # engine steps counted
    counts: list[list[int]]  # (layers, experts): tokens routed to each logical expert
    rank_loads: list[list[int]]  # (layers, ranks): tokens each rank's slots computed


@dataclass(frozen=True)
class PreparedPlacement:
    version: int
    layers: tuple[PhysicalExperts, ...]


class ExpertParallel:
    """Owned by the engine; every method but `prepare` runs on the engine thread."""

    def __init__(self, layers: list[tuple[int, MoELayer]], layout: ExpertLayout) -> None:
        self.layers = [module for _, module in layers]
        self.layout = layout
        self.version = 0
        self.num_steps = 0  # since the last report
        for module in self.layers:
            module.counters = ExpertCounters(layout.num_experts, layout.num_slots, module.w_gate_up.device)
        if layout.num_ranks > 1 or layout.num_slots > layout.num_experts:
            default = [slot % layout.num_experts for slot in range(layout.num_slots)]
            self.apply(self.prepare([default] * layout.num_layers, version=0), force=True)

    @classmethod
    def attach(cls, model: nn.Module, model_config: ModelConfig, config: EngineConfig) -> ExpertParallel | None:
        """Counters (and placements) on every MoE layer of `model`; None for a model without MoE layers."""
        layers = [
            (i, m)
            for i, layer in enumerate(model.model.layers)  # type: ignore[union-attr, arg-type]
            if isinstance(m := layer.mlp, (DeepseekMoE, V4MoE))
        ]
        if not layers:
            return None
        num_experts, num_groups = _experts(model_config)
        num_slots = num_experts + config.num_redundant_experts
        if num_slots % config.expert_parallel_size:
            raise ConfigError(
                f"expert_parallel_size {config.expert_parallel_size} must divide the {num_slots} expert slots "
                f"({num_experts} experts + num_redundant_experts {config.num_redundant_experts})"
            )
        layout = ExpertLayout(
            len(layers), layers[0][0], num_experts, num_groups, num_slots, config.expert_parallel_size
        )
        return cls(layers, layout)

    def note_step(self) -> None:
        self.num_steps += 1

    def take_report(self) -> ExpertLoadReport:
        """The counts since the last report; counting starts again from zero."""
        per_rank = self.layout.num_slots // self.layout.num_ranks
        counts, rank_loads = [], []
        for module in self.layers:
            assert module.counters is not None
            experts, slots = module.counters.take()
            counts.append(experts)
            rank_loads.append([sum(slots[r * per_rank : (r + 1) * per_rank]) for r in range(self.layout.num_ranks)])
        report = ExpertLoadReport(self.version, self.num_steps, counts, rank_loads)
        self.num_steps = 0
        return report

    def prepare(self, phy2log: Sequence[Sequence[int]], version: int) -> PreparedPlacement:
        """Every layer's new placement with its weights; any thread (reads only the logical weights).
        ValueError for a plan that does not fit this engine."""
        layout = self.layout
        if len(phy2log) != layout.num_layers:
            raise ValueError(f"a placement needs {layout.num_layers} MoE layers, got {len(phy2log)}")
        for layer, row in enumerate(phy2log):
            if len(row) != layout.num_slots:
                raise ValueError(f"layer {layer}: a placement needs {layout.num_slots} slots, got {len(row)}")
            if set(row) != set(range(layout.num_experts)):
                raise ValueError(
                    f"layer {layer}: every slot must hold an expert in [0, {layout.num_experts}) "
                    "and every expert needs a slot"
                )
        layers = tuple(
            PhysicalExperts.build(row, module.w_gate_up, module.w_down, layout.num_ranks, version)
            for row, module in zip(phy2log, self.layers, strict=True)
        )
        return PreparedPlacement(version, layers)

    def apply(self, prepared: PreparedPlacement, force: bool = False) -> bool:
        """Swap every layer's placement, between steps. False (nothing changes) for a version not newer than
        the current one, unless forced."""
        if prepared.version <= self.version and not force:
            return False
        for module, placement in zip(self.layers, prepared.layers, strict=True):
            module.placement = placement
        self.version = prepared.version
        return True

    def phy2log(self) -> list[list[int]]:
        """The current placement, (layers, slots)."""
        return [
            module.placement.phy2log.tolist() if module.placement is not None else list(range(self.layout.num_experts))
            for module in self.layers
        ]


def _experts(model_config: ModelConfig) -> tuple[int, int]:
    """(logical experts per MoE layer, groups of the gate's group-limited routing; 1 where it has none)."""
    if model_config.v4 is not None:
        return model_config.v4.num_experts, 1  # V4 routes without group limits (hash layers by a fixed table)
    assert model_config.moe is not None, "a model with MoE layers has a MoE config"
    return model_config.moe.num_experts, model_config.moe.num_groups
