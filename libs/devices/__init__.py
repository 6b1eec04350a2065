"""Device modules: one per accelerator family, all behind the `DeviceOps` contract (see base.py).

ops = get_device()          # the best family this machine has: cuda, then ascend, then cpu
ops = get_device("cpu")     # or ask for one by name
"""

from __future__ import annotations

import importlib.util

import torch

from devices.base import DecodeBatch, DeviceOps
from devices.cpu import CpuOps

DEVICE_NAMES = ("auto", "cpu", "cuda", "ascend")


def _has_cuda() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _has_ascend() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def get_device(name: str | None = None) -> DeviceOps:
    """The ops for device family `name` ("auto" or None picks the best one present)."""
    name = (name or "auto").lower()
    if name not in DEVICE_NAMES:
        raise ValueError(f"unknown device {name!r}: expected one of {', '.join(DEVICE_NAMES)}")
    if name == "auto":
        name = "cuda" if _has_cuda() else "ascend" if _has_ascend() else "cpu"
    if name == "cpu":
        return CpuOps()
    if name == "cuda":
        if not _has_cuda():
            raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA device or triton is not installed")
        from devices.cuda import CudaOps

        return CudaOps()
    if not _has_ascend():
        raise RuntimeError("device 'ascend' asked for, but torch_npu is not installed")
    from devices.ascend import AscendOps

    return AscendOps()


__all__ = ["DEVICE_NAMES", "CpuOps", "DecodeBatch", "DeviceOps", "get_device"]
