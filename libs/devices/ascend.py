"""Ascend NPUs through torch_npu. Fused ops where torch_npu has them; the rest run as the cpu module's torch ops
on the NPU device (they are written device-agnostically)."""

from __future__ import annotations

import torch
import torch_npu

from devices.cpu import CpuOps


class AscendOps(CpuOps):
    name = "ascend"

    def __init__(self) -> None:
        super().__init__(torch.device("npu"))

    def synchronize(self) -> None:
        torch.npu.synchronize()  # type: ignore[attr-defined]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch_npu.npu_swiglu(x, dim=-1)
