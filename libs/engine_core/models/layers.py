"""Small building blocks shared by the model definitions."""

from __future__ import annotations

import torch
from torch import nn

from devices.base import DeviceOps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: DeviceOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: DeviceOps) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


def fuse_gate_up(params: dict[str, torch.Tensor], prefix: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    params[f"{prefix}.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
